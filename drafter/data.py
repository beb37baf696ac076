"""Shard rows → per-sample tensors → packed varlen batches; the held-out split. The drafter's only
door to the shards: samples come from :class:`shards.stream.ShardStream` (bf16 states straight from the
Arrow buffers), batches from :func:`shards.pack.collate`, the split from :func:`shards.stream.in_split`.

Per sample::

    {"sample_id": str, "source": str,
     "input_ids": LongTensor [T], "loss_mask": BoolTensor [T], "argmax": LongTensor [T],
     "taps": bf16 [T, L, H]   (tap columns stacked in run-header order),
     "final": bf16 [T, H]     (only when the run stored it)}

Packed batch (flattened varlen, no padding)::

    {"input_ids": [N], "loss_mask": [N], "argmax": [N], "taps": [N, L, H], "final": [N, H] (optional),
     "position_ids": [N] (0-based within each sample), "cu_seqlens": int32 [B+1], "sample_ids": list[str]}
"""

from __future__ import annotations

import itertools
import os
from typing import Iterable, Iterator

from capture.errors import CaptureError
from shards.format import RunHeader
from shards.pack import collate
from shards.stream import ShardStream, in_split


def heldout(sample_id: str, fraction: float) -> bool:
    """True when ``sample_id`` belongs to the held-out split (:func:`shards.stream.in_split`: the first 8
    bytes of SHA-256(sample_id, UTF-8), big-endian, over 2**64, below ``fraction``). A sample never
    changes side across runs, machines and resumes."""
    return in_split(sample_id, "heldout", fraction)


def tap_columns(header: RunHeader) -> list[str]:
    """The ``tap_<k>`` columns of a run header, in header order (the order ``taps`` stacks them)."""
    return list(header.tap_columns)


def run_header(run_dir: str | os.PathLike) -> RunHeader:
    """The run header of ``run_dir``. Raises CaptureError when the folder holds no run, or a run stored
    without ``argmax`` (the drafter's labels and the offline score need it)."""
    from shards import manifest

    head = manifest.read(run_dir).header
    if head is None:
        raise CaptureError(f"{run_dir} holds no capture run (no manifest.jsonl header)")
    if not head.argmax:
        raise CaptureError(f"{run_dir} was captured with --no-argmax; the offline score (and the default labels) "
                           "need the target's greedy tokens, even when training uses --labels dataset")
    if not tap_columns(head):
        raise CaptureError(f"{run_dir} stores no tap_<k> columns")
    return head


def load_samples(run_dir: str | os.PathLike, split: str = "all", heldout_fraction: float = 0.0,
                 limit: int | None = None) -> Iterator[dict]:
    """Per-sample dicts of every committed row of ``run_dir`` (manifest order).

    ``split``: ``"all"``, ``"train"`` (not :func:`heldout`) or ``"heldout"``. ``limit``: at most that many
    samples of the split. Raises CaptureError as :func:`run_header` does or for an unknown split.
    """
    if split not in ("all", "train", "heldout"):
        raise CaptureError(f"unknown split {split!r} (all, train, heldout)")
    run_header(run_dir)
    yield from itertools.islice(ShardStream(run_dir, split=split, heldout_fraction=heldout_fraction), limit)


def pack(samples: Iterable[dict]) -> dict:
    """Concatenate samples into one flattened varlen batch (:func:`shards.pack.collate`: no padding,
    sample i spans ``cu_seqlens[i]:cu_seqlens[i+1]``, ``position_ids`` restart at 0 in every sample).
    Raises CaptureError for no samples."""
    samples = list(samples)
    if not samples:
        raise CaptureError("nothing to pack: no samples")
    return collate(samples)
