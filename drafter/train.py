"""Train a drafter on a capture run, score it offline, save and load checkpoints.

Outputs in ``cfg.out``: ``model.safetensors`` (trainable tensors and ``vocab``; the frozen target
embeddings are re-read from ``target_dir``), ``config.json`` (the :class:`TrainConfig`, the
:class:`ModelConfig`, the tap columns, the target folder and the SHA-256 of its embeddings) and
``metrics.jsonl`` (one JSON object a line: ``kind`` ``train`` every ``log_every`` steps, ``fixed_loss``
before and after training, ``eval`` for the untrained drafter, the bigram baseline and the trained
drafter on the held-out split).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from capture.errors import CaptureError
from shards.format import RunHeader
from shards.run import as_location
from drafter import blocks, data, metrics
from drafter.config import TrainConfig
from drafter.model import Drafter, ModelConfig, load_target_head

CHECKPOINT = "model.safetensors"
CONFIG = "config.json"
METRICS = "metrics.jsonl"


@dataclasses.dataclass
class Data:
    """A run's train and held-out splits as packed batches, with what a drafter needs besides."""

    header: RunHeader
    train: dict
    heldout: dict
    target_dir: Path
    embed: torch.Tensor  # [V, H], the stored dtype
    lm_head: torch.Tensor  # [V, H]


def default_target_dir(run_dir: str | os.PathLike) -> Path:
    """The model folder the run was captured with (``provenance.json``'s ``model_dir``). Raises
    CaptureError when it is not recorded or no longer exists (pass ``target_dir`` then)."""
    try:
        model_dir = json.loads(as_location(str(run_dir)).read_bytes("provenance.json")).get("model_dir")
    except (OSError, ValueError, CaptureError):
        model_dir = None
    if not model_dir or not Path(model_dir).is_dir():
        raise CaptureError(f"{run_dir}: no usable model_dir in provenance.json; pass --target-dir")
    return Path(model_dir)


def load_data(run: str, heldout_fraction: float, target_dir: str | None = None) -> Data:
    """Read every committed row of ``run`` into memory, split by :func:`drafter.data.heldout`. Raises
    CaptureError when either split is empty or the target folder has no embeddings."""
    header = data.run_header(run)
    tdir = Path(target_dir) if target_dir else default_target_dir(run)
    train, held = [], []
    for s in data.load_samples(run):
        (held if data.heldout(s["sample_id"], heldout_fraction) else train).append(s)
    if not train or not held:
        raise CaptureError(f"{run}: {len(train)} train and {len(held)} held-out conversations at "
                           f"heldout_fraction {heldout_fraction}; both splits need at least one")
    embed, lm_head = load_target_head(tdir)
    if embed.shape[1] != header.hidden_size:
        raise CaptureError(f"{tdir}: hidden size {embed.shape[1]} but the run stores {header.hidden_size}")
    return Data(header, data.pack(train), data.pack(held), tdir, embed, lm_head)


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's raw bytes (its dtype as stored, C order)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def build_model(cfg: TrainConfig, d: Data) -> Drafter:
    """A freshly initialized drafter (``torch.manual_seed(cfg.seed)`` first, so the same seed gives the
    same weights). Its vocabulary is the train split's labels or the full one (``cfg.head_vocab``)."""
    mcfg = ModelConfig(num_taps=len(data.tap_columns(d.header)), hidden_size=d.header.hidden_size,
                       vocab_size=d.embed.shape[0], d_model=cfg.d_model, n_layers=cfg.n_layers,
                       n_heads=cfg.n_heads, block_size=cfg.block_size, context=cfg.context)
    vocab = None
    if cfg.head_vocab == "train-labels":
        anchors = blocks.valid_anchors(d.train["loss_mask"], d.train["position_ids"])
        labels, valid = blocks.block_targets(d.train, anchors, 1, cfg.labels)
        vocab = torch.unique(labels[valid])
    torch.manual_seed(cfg.seed)
    return Drafter(mcfg, d.embed, d.lm_head, vocab)


def _vocab_index(model: Drafter) -> torch.Tensor:
    """int64 [V]: column of each token id in the model's logits, -1 where it is not scored."""
    index = torch.full((model.cfg.vocab_size,), -1, dtype=torch.long)
    index[model.vocab] = torch.arange(len(model.vocab))
    return index


def block_loss(model: Drafter, batch: dict, anchors: torch.Tensor, labels_kind: str, loss_decay: float
               ) -> torch.Tensor:
    """Weighted cross-entropy over the valid block positions of ``anchors`` (a scalar, float32).
    Position j weighs ``exp(-j / loss_decay)`` (all 1 when loss_decay is 0); labels outside the model's
    vocabulary are skipped."""
    B = model.cfg.block_size
    labels, valid = blocks.block_targets(batch, anchors, B, labels_kind)
    idx, keep = blocks.context_window(anchors, batch["position_ids"], model.cfg.context)
    hidden = model(batch["taps"], batch["input_ids"], idx, keep)
    cols = _vocab_index(model)[labels]
    valid = valid & (cols >= 0)
    w = torch.exp(-torch.arange(B, dtype=torch.float32) / loss_decay) if loss_decay else torch.ones(B)
    w = (w * valid).flatten()
    rows = w > 0
    ce = F.cross_entropy(model.logits(hidden.flatten(0, 1)[rows]), cols.flatten()[rows], reduction="none")
    return (ce * w[rows]).sum() / w.sum().clamp(min=1e-9)


def eval_anchors(batch: dict, limit: int) -> torch.Tensor:
    """The anchors scored: every valid anchor of ``batch``, or ``limit`` of them evenly spaced (0: all)."""
    anchors = blocks.valid_anchors(batch["loss_mask"], batch["position_ids"])
    if limit and len(anchors) > limit:
        anchors = anchors[torch.arange(limit) * len(anchors) // limit]
    return anchors


@torch.no_grad()
def evaluate(model: Drafter, batch: dict, anchors: torch.Tensor, batch_size: int = 256) -> dict:
    """Offline score of ``model`` on ``anchors`` of ``batch`` against the target's greedy tokens
    (:mod:`drafter.metrics`): accept_len, accept_len_with_bonus, first_token_acc, position_acc, blocks."""
    model.eval()
    score = metrics.Score()
    for start in range(0, len(anchors), batch_size):
        a = anchors[start:start + batch_size]
        labels, valid = blocks.block_targets(batch, a, model.cfg.block_size, "argmax")
        idx, keep = blocks.context_window(a, batch["position_ids"], model.cfg.context)
        pred = model.vocab[model.logits(model(batch["taps"], batch["input_ids"], idx, keep)).argmax(-1)]
        score.add(pred, labels, valid)
    return score.as_dict()


def evaluate_bigram(train: dict, heldout: dict, anchors: torch.Tensor, block_size: int, vocab_size: int) -> dict:
    """The bigram baseline fitted on the train split's anchors, scored like :func:`evaluate`."""
    fit = blocks.valid_anchors(train["loss_mask"], train["position_ids"])
    table = metrics.fit_bigram(train["input_ids"], train["argmax"], fit, vocab_size)
    labels, valid = blocks.block_targets(heldout, anchors, block_size, "argmax")
    score = metrics.Score()
    score.add(metrics.bigram_draft(table, heldout["input_ids"][anchors], block_size), labels, valid)
    return score.as_dict()


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def train(cfg: TrainConfig, d: Data | None = None) -> dict:
    """Train a drafter as ``cfg`` says and write the outputs (module docstring) into ``cfg.out``.
    ``d``: preloaded data (:func:`load_data` with the same run and held-out fraction), else read here.
    Returns ``{"untrained", "bigram", "drafter"}`` held-out scores, ``fixed_loss`` before/after, ``seconds``
    (training loop only). Anchors are drawn uniformly from the train split's valid anchors with a
    generator seeded by ``cfg.seed``, so a run is reproducible on one machine."""
    d = d or load_data(cfg.run, cfg.heldout_fraction, cfg.target_dir)
    out = Path(cfg.out)
    if (out / "model.safetensors").exists():
        raise CaptureError(f"{out} already holds a trained drafter; train into another --out")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / METRICS, "w") as log:

        def emit(entry: dict) -> None:
            log.write(json.dumps(entry) + "\n")
            log.flush()

        return _train(cfg, d, out, emit)


def _train(cfg: TrainConfig, d: Data, out: Path, emit) -> dict:
    model = build_model(cfg, d)
    held = eval_anchors(d.heldout, cfg.eval_anchors)
    train_anchors = blocks.valid_anchors(d.train["loss_mask"], d.train["position_ids"])
    gen = torch.Generator().manual_seed(cfg.seed)
    fixed = train_anchors[torch.randperm(len(train_anchors), generator=gen)[:1024]]
    result = {"untrained": evaluate(model, d.heldout, held, cfg.eval_batch),
              "bigram": evaluate_bigram(d.train, d.heldout, held, cfg.block_size, model.cfg.vocab_size)}
    for name in ("untrained", "bigram"):
        emit({"kind": "eval", "model": name, "split": "heldout", **result[name]})
    with torch.no_grad():
        result["fixed_loss"] = [float(block_loss(model, d.train, fixed, cfg.labels, cfg.loss_decay))]
    emit({"kind": "fixed_loss", "step": 0, "loss": result["fixed_loss"][0]})

    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"train seed {cfg.seed}", unit="step", disable=not cfg.progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        pick = torch.randint(len(train_anchors), (cfg.anchors_per_step,), generator=gen)
        loss = block_loss(model, d.train, train_anchors[pick], cfg.labels, cfg.loss_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            emit({"kind": "train", "step": step + 1, "loss": loss.item(), "lr": _lr(cfg, step),
                  "seconds": round(time.perf_counter() - start, 2)})
    result["seconds"] = round(time.perf_counter() - start, 2)
    with torch.no_grad():
        result["fixed_loss"].append(float(block_loss(model, d.train, fixed, cfg.labels, cfg.loss_decay)))
    emit({"kind": "fixed_loss", "step": cfg.steps, "loss": result["fixed_loss"][1]})
    save_checkpoint(model, cfg, d, out)
    result["drafter"] = evaluate(model, d.heldout, held, cfg.eval_batch)
    emit({"kind": "eval", "model": "drafter", "split": "heldout", "train_seconds": result["seconds"],
          **result["drafter"]})
    return result


def save_checkpoint(model: Drafter, cfg: TrainConfig, d: Data, out: str | os.PathLike) -> None:
    """Write ``model.safetensors`` and ``config.json`` into ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / CHECKPOINT))
    meta = {"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(model.cfg),
            "taps": data.tap_columns(d.header), "target": d.header.target,
            "target_dir": str(d.target_dir), "embed_sha256": tensor_sha256(d.embed),
            "lm_head_sha256": tensor_sha256(d.lm_head)}
    (out / CONFIG).write_text(json.dumps(meta, indent=1) + "\n")


def load_checkpoint(path: str | os.PathLike, target_dir: str | None = None) -> tuple[Drafter, dict]:
    """(drafter in eval mode, config.json contents) from a folder written by :func:`save_checkpoint`.
    The frozen target tensors are read from ``target_dir`` (default: the recorded one) and must hash
    as recorded. Raises CaptureError for a missing or foreign checkpoint or other target weights."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        meta = json.loads((path / CONFIG).read_text())
        state = load_file(str(path / CHECKPOINT))
    except (OSError, ValueError) as e:
        raise CaptureError(f"{path}: not a drafter checkpoint ({e})") from None
    tdir = Path(target_dir or meta["target_dir"])
    embed, lm_head = load_target_head(tdir)
    if tensor_sha256(embed) != meta["embed_sha256"] or tensor_sha256(lm_head) != meta["lm_head_sha256"]:
        raise CaptureError(f"{tdir}: its embeddings / LM head are not the ones {path} was trained with")
    model = Drafter(ModelConfig(**meta["model"]), embed, lm_head, state["vocab"])
    model.load_state_dict(state)
    return model.eval(), meta


def evaluate_checkpoint(path: str | os.PathLike, run: str, split: str = "heldout",
                        heldout_fraction: float | None = None, limit: int | None = None,
                        target_dir: str | None = None) -> dict:
    """Score a saved drafter on ``run``'s ``split`` (``heldout``, ``train`` or ``all``; the held-out
    fraction defaults to the one it was trained with; ``limit`` anchors as in :func:`eval_anchors`,
    default the training config's ``eval_anchors``). Raises CaptureError when the run's taps differ from
    the checkpoint's."""
    model, meta = load_checkpoint(path, target_dir)
    header = data.run_header(run)
    if data.tap_columns(header) != meta["taps"] or header.hidden_size != model.cfg.hidden_size:
        raise CaptureError(f"{run} stores {data.tap_columns(header)} (hidden {header.hidden_size}); "
                           f"the drafter was trained on {meta['taps']} (hidden {model.cfg.hidden_size})")
    fraction = meta["train"]["heldout_fraction"] if heldout_fraction is None else heldout_fraction
    samples = list(data.load_samples(run, split, fraction))
    if not samples:
        raise CaptureError(f"{run}: no {split} conversations at heldout_fraction {fraction}")
    batch = data.pack(samples)
    anchors = eval_anchors(batch, meta["train"]["eval_anchors"] if limit is None else limit)
    return {"split": split, **evaluate(model, batch, anchors, meta["train"]["eval_batch"])}
