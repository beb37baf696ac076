"""One frozen dataclass configures drafter training; the CLI, a YAML file and Python callers build it."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from common.errors import CaptureError


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything :func:`drafter.train.train` needs (block conventions: :mod:`drafter.blocks`).

    Units: ``steps`` optimizer steps of ``anchors_per_step // anchors_per_seq`` conversations each (the
    next ones of the rank's shuffled stream, epochs following each other), one batch row a conversation
    holding up to ``anchors_per_seq`` of its valid anchors drawn at random (DFlash's per-sequence anchor
    sampling; :func:`drafter.data.pick_anchors`);
    ``lr`` per step (AdamW, linear warm-up over ``warmup_steps`` then cosine to 0). ``window``: context
    positions a block attends to (DFlash 2: 2,048). ``loss_decay``: slot j's loss weighs
    ``exp(-(j-1) / loss_decay)`` (0: all equal; DFlash's decay, since a block's acceptance stops at its
    first miss). ``kl_weight``: adds that times the cross-entropy against the target's stored top-K
    distribution (renormalized over the K ids the head scores; the run must be captured with ``--topk``)
    to the argmax cross-entropy. ``head_vocab``: ``"train-labels"`` scores only token ids that occur as
    labels in the train split (several times cheaper than the full vocabulary on CPU; a held-out label
    outside it is a miss), ``"full"`` the whole vocabulary; ``draft_vocab_size`` N > 0 keeps only the N
    most frequent train labels (EAGLE-3's reduced draft vocabulary; 0: all). ``heldout_run``: score on that run (every
    row) instead of a ``heldout_fraction`` split of ``run``; either way, train rows sharing a sample_id
    or a prompt with a held-out row are dropped (:func:`drafter.data.disjoint`). ``eval_anchors``:
    held-out anchors scored, an evenly spaced deterministic subsample (0: all). ``precision``: the
    autocast dtype of the forward (weights and optimizer stay float32); ``auto``: bfloat16 where the CPU
    computes it natively, else float32 (:func:`drafter.evaluate.resolve_precision`).
    """

    run: str  # capture run folder (shards + manifest.jsonl); with `online`, that capture's --out
    out: str  # output folder: model.safetensors, config.json, metrics.jsonl
    # a `capture run --config` YAML: capture it now and train on its rows straight from the Ray replicas
    # (capture.online; no shards, only the run's log in its out folder); None: read `run`'s shards
    online: str | None = None
    # True: `run` is a capture still writing its shards: train on its rows as they are committed (tail mode,
    # drafter.live; needs heldout_run)
    follow: bool = False
    target_dir: str | None = None  # model folder with the target's safetensors (default: provenance.json's)
    heldout_run: str | None = None
    seed: int = 0
    block_size: int = 8
    window: int = 2048
    d_model: int = 256
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    lookup: int = 2
    steps: int = 600
    anchors_per_step: int = 512
    anchors_per_seq: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 30
    loss_decay: float = 4.0
    labels: Literal["argmax", "dataset"] = "argmax"
    kl_weight: float = 0.0
    head_vocab: Literal["train-labels", "full"] = "train-labels"
    draft_vocab_size: int = 0
    heldout_fraction: float = 0.1
    train_rows: int = 0  # train on the first N train conversations of the run (manifest order; 0: all)
    train_anchors: int = 0  # train on the first train conversations that hold N valid anchors (0: no limit)
    eval_anchors: int = 8192
    eval_rows: int = 8
    precision: Literal["auto", "bfloat16", "float32"] = "auto"
    log_every: int = 10
    workers: int = 1  # DataLoader processes decoding conversations (0: in the training process)
    shuffle_buffer: int = 1024  # rows of the stream's shuffle buffer (shard/row numbers, not states)
    checkpoint_every: int = 100  # steps between training checkpoints (and one at the end)
    vocab_warmup: int = 64  # online/follow: train conversations whose labels make the head vocabulary (drafter.live)
    progress: bool = True


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def from_mapping(values: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from flat keys (YAML or CLI flags; ``-`` and ``_`` are the same; None values are
    ignored). Raises CaptureError for an unknown key, a missing ``run``/``out``, a value of the wrong type
    or an invalid value."""
    flat = {k.replace("-", "_"): v for k, v in values.items() if v is not None}
    unknown = sorted(set(flat) - set(_FIELDS))
    if unknown:
        raise CaptureError(f"unknown drafter config key(s): {', '.join(unknown)}")
    if "online" in flat and "run" not in flat:  # the online capture's folder
        from capture.config import load_yaml

        flat["run"] = load_yaml(flat["online"]).get("out")
    for key in ("run", "out"):
        if key not in flat or flat[key] is None:
            raise CaptureError(f"--{key} is required")
    hints = typing.get_type_hints(TrainConfig)
    for key, value in flat.items():
        flat[key] = _check_type(key, value, hints[key])
    cfg = TrainConfig(**flat)
    validate(cfg)
    return cfg


def _check_type(key: str, value, hint):
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        if value not in args:
            raise CaptureError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is int and isinstance(value, bool) or not isinstance(value, base):
        raise CaptureError(f"{key}: expected {base.__name__}, got {value!r}")
    return value


def validate(cfg: TrainConfig) -> None:
    """Raise CaptureError for values no drafter can train with."""
    positive = ("window", "d_model", "n_layers", "n_heads", "steps", "anchors_per_step", "anchors_per_seq",
                "eval_rows", "log_every", "shuffle_buffer", "checkpoint_every", "vocab_warmup")
    bad = [k for k in positive if getattr(cfg, k) < 1]
    if bad:
        raise CaptureError(f"must be at least 1: {', '.join(bad)}")
    if cfg.block_size < 2:
        raise CaptureError(f"block_size must be at least 2 (slot 0 is the anchor token), got {cfg.block_size}")
    if cfg.d_model % cfg.n_heads or (cfg.d_model // cfg.n_heads) % 2:
        raise CaptureError(f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads} into an even "
                           "head size (rotary embeddings rotate pairs)")
    if not 0 <= cfg.dropout < 1:
        raise CaptureError(f"dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.follow and cfg.online:
        raise CaptureError("--follow (a run on disk a capture is writing) and --online (rows from Ray) exclude each other")
    if (cfg.follow or cfg.online) and (cfg.train_rows or cfg.train_anchors):
        raise CaptureError("--train-rows/--train-anchors pick rows of a finished run; --follow/--online train on "
                           "every row the capture delivers")
    if not 0 < cfg.heldout_fraction < 1:
        raise CaptureError(f"heldout_fraction must be in (0, 1), got {cfg.heldout_fraction}")
    if (cfg.lr <= 0 or cfg.loss_decay < 0 or cfg.eval_anchors < 0 or cfg.warmup_steps < 0 or cfg.kl_weight < 0
            or cfg.draft_vocab_size < 0 or cfg.lookup < 0 or cfg.workers < 0 or cfg.train_rows < 0
            or cfg.train_anchors < 0):
        raise CaptureError("lr must be > 0; loss_decay, kl_weight, eval_anchors, warmup_steps, draft_vocab_size, "
                           "lookup, workers, train_rows and train_anchors must be >= 0")
