"""A drafter's files: the trained drafter (``save`` / ``load``) and the training checkpoints a killed
trainer resumes from (``save_state`` / ``load_state``).

**Trained drafter**, in the output folder: ``model.safetensors`` (trainable tensors and ``vocab``; the
frozen target embeddings are re-read from ``target_dir``), ``config.json`` (the :class:`TrainConfig`,
the :class:`ModelConfig`, the tap columns, the target folder and the SHA-256 of its embeddings) and
``train_set.npz`` (:func:`drafter.data.fingerprint` of the train split: a later evaluation skips any row
sharing a sample_id or a prompt with it).

**Training checkpoints**, in ``OUT/checkpoints/``: one folder ``step-NNNNNNNN`` a checkpoint
(``model.safetensors``; ``optimizer.pt``: the AdamW state and every rank's torch RNG state;
``state.json``: the step, every rank's :meth:`shards.stream.ShardStream.state_dict`, the world size, the
byte length of each log file at that step and the training config) and ``latest`` naming the newest.
A checkpoint is written into a ``.tmp`` folder, renamed, and only then named in ``latest`` (an atomic
``os.replace``); the older ones are removed after that. A trainer killed at any point therefore finds
the last complete checkpoint, and one that cannot write (a full disk) keeps it and says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from common.errors import CaptureError
from drafter.model import Drafter, ModelConfig, load_target_head

CHECKPOINT = "model.safetensors"
CONFIG = "config.json"
TRAIN_SET = "train_set.npz"
STATES = "checkpoints"
LATEST = "latest"


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's raw bytes (its dtype as stored, C order)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def meta(cfg, header, target_dir: Path, embed: torch.Tensor, lm_head: torch.Tensor) -> dict:
    """What ``config.json`` records beside the model config: the :class:`TrainConfig` ``cfg``, the tap
    columns, target and tokenizer of the run ``header``, the target folder and the SHA-256 of its frozen
    tensors (checked by :func:`load`)."""
    return {"train": dataclasses.asdict(cfg), "taps": list(header.tap_columns), "target": header.target,
            "tokenizer_sha256": header.tokenizer_sha256, "target_dir": str(target_dir),
            "embed_sha256": tensor_sha256(embed), "lm_head_sha256": tensor_sha256(lm_head)}


def save(model: Drafter, meta: dict, prints: dict[str, np.ndarray], out: str | os.PathLike) -> None:
    """Write ``model.safetensors``, ``config.json`` (``meta`` plus the model config) and ``train_set.npz``
    (``prints``) into ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / CHECKPOINT))
    (out / CONFIG).write_text(json.dumps({**meta, "model": dataclasses.asdict(model.cfg)}, indent=1) + "\n")
    np.savez(out / TRAIN_SET, **prints)


def load(path: str | os.PathLike, target_dir: str | None = None) -> tuple[Drafter, dict]:
    """(drafter in eval mode, config.json contents) from a folder written by :func:`save`. The frozen
    target tensors are read from ``target_dir`` (default: the recorded one) and must hash as recorded.
    Raises CaptureError for a missing or foreign checkpoint or other target weights."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CHECKPOINT).exists() and latest(path) is not None:
        raise CaptureError(f"{path}: training not finished (a training checkpoint, no drafter yet); rerun "
                           "`capture drafter train` with this --out to resume it")
    try:
        meta = json.loads((path / CONFIG).read_text())
        state = load_file(str(path / CHECKPOINT))
    except Exception as e:  # noqa: BLE001 - OSError, JSON, safetensors' own error for a damaged file
        raise CaptureError(f"{path}: not a drafter checkpoint ({str(e).splitlines()[0]})") from None
    tdir = Path(target_dir or meta["target_dir"])
    embed, lm_head = load_target_head(tdir)
    if tensor_sha256(embed) != meta["embed_sha256"] or tensor_sha256(lm_head) != meta["lm_head_sha256"]:
        raise CaptureError(f"{tdir}: its embeddings / LM head are not the ones {path} was trained with")
    model = Drafter(ModelConfig(**meta["model"]), embed, lm_head, state["vocab"])
    model.load_state_dict(state)
    return model.eval(), meta


def latest(out: str | os.PathLike) -> Path | None:
    """The newest complete training checkpoint folder in ``out``, or None."""
    pointer = Path(out) / STATES / LATEST
    if not pointer.is_file():
        return None
    folder = pointer.parent / pointer.read_text().strip()
    return folder if (folder / "state.json").is_file() else None


def save_state(out: str | os.PathLike, step: int, model: Drafter, optimizer: torch.optim.Optimizer,
               rng: list[torch.Tensor], state: dict, extra: dict | None = None) -> Path:
    """Write the training checkpoint of ``step`` (module docstring): ``state`` (JSON-able: streams, world
    size, log lengths, config) plus the step; ``extra``: tensors, strings and lists a trainer keeps beside
    (:func:`load_extra`). Returns its folder. Raises CaptureError, after removing its partial folder, when
    it cannot be written (the previous checkpoint stays the latest)."""
    from safetensors.torch import save_file

    root = Path(out) / STATES
    name = f"step-{step:08d}"
    tmp, final = root / f".{name}.tmp", root / name
    before = latest(out)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / CHECKPOINT))
        torch.save({"optimizer": optimizer.state_dict(), "rng": rng, "extra": extra or {}}, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        (root / f".{LATEST}.tmp").write_text(name + "\n")
        os.replace(root / f".{LATEST}.tmp", root / LATEST)
    except Exception as e:  # noqa: BLE001 - OSError, and what torch / safetensors raise on a full disk
        shutil.rmtree(tmp, ignore_errors=True)
        kept = (f"the last good one is {before}: free space and rerun the same command to resume from it" if before
                else "no earlier checkpoint")
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise CaptureError(f"cannot write the checkpoint of step {step} in {root} ({why}); {kept}") from None
    for old in root.glob("step-*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(folder: Path) -> dict:
    """A training checkpoint's ``state.json``. Raises CaptureError when it cannot be read."""
    try:
        return json.loads((folder / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise CaptureError(f"{folder}: not a readable training checkpoint ({e})") from None


def load_state(folder: Path, model: Drafter, optimizer: torch.optim.Optimizer) -> tuple[dict, list[torch.Tensor]]:
    """Load a training checkpoint into ``model`` and ``optimizer``; returns (state.json, every rank's RNG
    state). Raises CaptureError for an unreadable checkpoint."""
    from safetensors.torch import load_file

    try:
        state = json.loads((folder / "state.json").read_text())
        tensors = load_file(str(folder / CHECKPOINT))
        saved = torch.load(folder / "optimizer.pt", weights_only=True)
    except Exception as e:  # noqa: BLE001 - OSError, JSON, torch's and safetensors' errors for a damaged file
        raise CaptureError(f"{folder}: not a readable training checkpoint ({str(e).splitlines()[0]}); train into "
                           "another --out") from None
    if tensors["vocab"].shape != model.vocab.shape or not torch.equal(tensors["vocab"], model.vocab):
        raise CaptureError(f"{folder}: the run changed since this checkpoint (its train labels differ); train into "
                           "another --out")
    model.load_state_dict(tensors)
    optimizer.load_state_dict(saved["optimizer"])
    return state, saved["rng"]


def load_extra(folder: Path) -> dict:
    """The ``extra`` dict a training checkpoint was saved with (:func:`save_state`)."""
    try:
        return torch.load(folder / "optimizer.pt", weights_only=True)["extra"]
    except (OSError, RuntimeError, KeyError) as e:
        raise CaptureError(f"{folder}: not a readable training checkpoint ({e})") from None
