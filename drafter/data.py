"""Shard rows → per-sample tensors → packed varlen batches; the held-out split.

**This module is the place to swap in ``shards.stream``** (the streaming reader being built in
parallel): :func:`load_samples` and :func:`pack` are a tiny stand-in over
:func:`shards.reader.iter_rows` with the contract agreed with the reader, and :func:`heldout` is the
same split function the reader will offer. Nothing else in :mod:`drafter` reads shards.

Per sample (:func:`to_sample`)::

    {"sample_id": str, "source": str,
     "input_ids": LongTensor [T], "loss_mask": BoolTensor [T], "argmax": LongTensor [T],
     "taps": bf16 [T, L, H]   (tap columns stacked in run-header order),
     "final": bf16 [T, H]     (only when the run stored it)}

Packed batch (:func:`pack`, flattened varlen, no padding)::

    {"input_ids": [N], "loss_mask": [N], "argmax": [N], "taps": [N, L, H], "final": [N, H] (optional),
     "position_ids": [N] (0-based within each sample), "cu_seqlens": int32 [B+1], "sample_ids": list[str]}
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, Iterator

import numpy as np
import torch

from capture.errors import CaptureError


def heldout(sample_id: str, fraction: float) -> bool:
    """True when ``sample_id`` belongs to the held-out split: the first 8 bytes of SHA-256(sample_id,
    UTF-8) read as a big-endian integer, divided by 2**64, is below ``fraction`` (0 ≤ fraction ≤ 1).
    Deterministic across runs, machines and resumes (a sample never changes side); the convention shared
    with ``shards.stream``."""
    value = int.from_bytes(hashlib.sha256(sample_id.encode("utf-8")).digest()[:8], "big")
    return value / 2**64 < fraction


def tap_columns(header: dict) -> list[str]:
    """The ``tap_<k>`` columns of a run header, in header order (the order ``taps`` stacks them)."""
    return [c for c in header["columns"] if c.startswith("tap_")]


def run_header(run_dir: str | os.PathLike) -> dict:
    """The run header of ``run_dir``. Raises CaptureError when the folder holds no run, or a run stored
    without ``argmax`` (the drafter's labels and the offline score need it)."""
    from shards import manifest

    head = manifest.read(run_dir).header
    if head is None:
        raise CaptureError(f"{run_dir} holds no capture run (no manifest.jsonl header)")
    if not head.get("argmax"):
        raise CaptureError(f"{run_dir} was captured with --no-argmax; a drafter needs the target's greedy tokens")
    if not tap_columns(head):
        raise CaptureError(f"{run_dir} stores no tap_<k> columns")
    return head


def to_sample(row: dict, taps: list[str]) -> dict:
    """One :func:`shards.reader.iter_rows` row → the per-sample dict above (``taps`` in header order)."""
    sample = {
        "sample_id": row["sample_id"],
        "source": row["source"],
        "input_ids": torch.from_numpy(np.asarray(row["input_ids"], dtype=np.int64)),
        "loss_mask": torch.from_numpy(np.asarray(row["loss_mask"], dtype=bool)),
        "argmax": torch.from_numpy(np.asarray(row["argmax"], dtype=np.int64)),
        "taps": torch.stack([row[c] for c in taps], dim=1),
    }
    if "final" in row:
        sample["final"] = row["final"]
    return sample


def load_samples(run_dir: str | os.PathLike, split: str = "all", heldout_fraction: float = 0.0,
                 limit: int | None = None) -> Iterator[dict]:
    """Per-sample dicts of every committed row of ``run_dir`` (manifest order).

    ``split``: ``"all"``, ``"train"`` (not :func:`heldout`) or ``"heldout"``. ``limit``: at most that many
    samples of the split. Raises CaptureError as :func:`run_header` does or for an unknown split.
    """
    from shards.reader import iter_rows

    if split not in ("all", "train", "heldout"):
        raise CaptureError(f"unknown split {split!r} (all, train, heldout)")
    taps = tap_columns(run_header(run_dir))
    n = 0
    for row in iter_rows(run_dir):
        if split != "all" and heldout(row["sample_id"], heldout_fraction) != (split == "heldout"):
            continue
        if limit is not None and n >= limit:
            return
        n += 1
        yield to_sample(row, taps)


def pack(samples: Iterable[dict]) -> dict:
    """Concatenate samples into one flattened varlen batch (the layout above): no padding, sample i
    spans ``cu_seqlens[i]:cu_seqlens[i+1]``, ``position_ids`` restart at 0 in every sample."""
    samples = list(samples)
    if not samples:
        raise CaptureError("nothing to pack: no samples")
    lengths = [len(s["input_ids"]) for s in samples]
    batch = {k: torch.cat([s[k] for s in samples]) for k in ("input_ids", "loss_mask", "argmax", "taps")}
    if all("final" in s for s in samples):
        batch["final"] = torch.cat([s["final"] for s in samples])
    batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])
    batch["cu_seqlens"] = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    batch["sample_ids"] = [s["sample_id"] for s in samples]
    return batch


def batches_by_tokens(samples: list[dict], max_tokens: int, order: list[int] | None = None) -> Iterator[dict]:
    """Packed batches of consecutive samples (in ``order``, default as given) of at most ``max_tokens``
    tokens each; a sample longer than ``max_tokens`` is a batch of its own."""
    order = list(range(len(samples))) if order is None else order
    group, tokens = [], 0
    for i in order:
        n = len(samples[i]["input_ids"])
        if group and tokens + n > max_tokens:
            yield pack(group)
            group, tokens = [], 0
        group.append(samples[i])
        tokens += n
    if group:
        yield pack(group)
