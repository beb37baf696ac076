"""Train a drafter on a capture run, score it offline, save and load checkpoints.

Outputs in ``cfg.out``: ``model.safetensors`` (trainable tensors and ``vocab``; the frozen target
embeddings are re-read from ``target_dir``), ``config.json`` (the :class:`TrainConfig`, the
:class:`ModelConfig`, the tap columns, the target folder and the SHA-256 of its embeddings),
``train_set.npz`` (:func:`drafter.data.fingerprint` of the conversations trained on: a later
``evaluate_checkpoint`` skips any row sharing a sample_id or a prompt with them) and ``metrics.jsonl``
(one JSON object a line: ``data`` (conversations, tokens, anchors, overlaps removed), ``train`` every
``log_every`` steps, ``fixed_loss`` before and after training, ``eval`` for the untrained drafter, the
bigram baseline and the trained drafter on the held-out set).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from common.errors import CaptureError
from shards.format import RunHeader
from shards.run import MANIFEST, MANIFEST_DIR, as_location
from drafter import blocks, data, metrics
from drafter.config import TrainConfig
from drafter.model import Drafter, ModelConfig, load_target_head

CHECKPOINT = "model.safetensors"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
TRAIN_SET = "train_set.npz"


@dataclasses.dataclass
class Data:
    """Train and held-out conversations (:func:`drafter.data.prepare` dicts) and what a drafter needs
    besides. ``overlap``: train conversations dropped for sharing a sample_id or prompt with a held-out one."""

    header: RunHeader
    train: list[dict]
    heldout: list[dict]
    target_dir: Path
    embed: torch.Tensor  # [V, H], the stored dtype
    lm_head: torch.Tensor  # [V, H]
    overlap: int = 0

    def summary(self) -> dict:
        def count(seqs):
            return {"conversations": len(seqs), "tokens": sum(len(s["input_ids"]) for s in seqs),
                    "anchors": sum(len(blocks.valid_anchors(s["loss_mask"])) for s in seqs)}

        return {"train": count(self.train), "heldout": count(self.heldout), "overlap_removed": self.overlap}


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


def check_compatible(run: str, header: RunHeader, other: str, theirs: RunHeader) -> None:
    """Raise CaptureError unless two runs store the same taps, hidden size and tokenizer (a drafter
    trained on one can be scored on the other)."""
    for what, mine, other_value in (("taps", data.tap_columns(header), data.tap_columns(theirs)),
                                    ("hidden size", header.hidden_size, theirs.hidden_size),
                                    ("tokenizer", header.tokenizer_sha256, theirs.tokenizer_sha256)):
        if mine != other_value:
            raise CaptureError(f"{other} has {what} {other_value}, {run} has {mine}: not the same target capture")


def load_data(run: str, heldout_fraction: float, target_dir: str | None = None,
              heldout_run: str | None = None, topk: bool = False, online: str | None = None) -> Data:
    """Read the conversations of ``run`` into memory. Held out: every row of ``heldout_run`` when given,
    else ``run``'s :func:`drafter.data.heldout` split; train rows sharing a sample_id or prompt with a
    held-out row are dropped (counted). ``topk``: the runs must store top-K logits. ``online``: a capture
    config YAML; its rows come straight from a live capture (:func:`drafter.data.online_samples`) instead
    of ``run``'s shards. Raises CaptureError when either set is empty, the runs differ in taps or
    tokenizer, or the target folder has no embeddings."""
    if online:
        header, samples, run = data.online_samples(online, topk=topk)
    else:
        header, samples = data.run_header(run), data.load_samples(run, topk=topk)
    if topk and not header.topk:
        raise CaptureError(f"{run} stores no top-K logits (capture it with --topk K) but kl_weight > 0")
    tdir = Path(target_dir) if target_dir else default_target_dir(run)
    if heldout_run:
        check_compatible(run, header, heldout_run, data.run_header(heldout_run))
        train, held = list(samples), list(data.load_samples(heldout_run))
        where = f"{heldout_run} (all rows)"
    else:
        train, held = [], []
        for s in samples:
            (held if data.heldout(s["sample_id"], heldout_fraction) else train).append(s)
        where = f"heldout_fraction {heldout_fraction}"
    train, overlap = data.disjoint(train, held)
    if not train or not held:
        raise CaptureError(f"{run}: {len(train)} train and {len(held)} held-out conversations ({where}); "
                           "both sets need at least one: capture more rows or change --heldout-fraction")
    embed, lm_head = load_target_head(tdir)
    if embed.shape[1] != header.hidden_size:
        raise CaptureError(f"{tdir}: hidden size {embed.shape[1]} but the run stores {header.hidden_size}")
    return Data(header, train, held, tdir, embed, lm_head, overlap)


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's raw bytes (its dtype as stored, C order)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def build_model(cfg: TrainConfig, d: Data) -> Drafter:
    """A freshly initialized drafter (``torch.manual_seed(cfg.seed)`` first, so the same seed gives the
    same weights). Its vocabulary is the train split's labels (the ``cfg.draft_vocab_size`` most frequent
    of them, when set) or the full one (``cfg.head_vocab``)."""
    mcfg = ModelConfig(num_taps=len(data.tap_columns(d.header)), hidden_size=d.header.hidden_size,
                       vocab_size=d.embed.shape[0], d_model=cfg.d_model, n_layers=cfg.n_layers,
                       n_heads=cfg.n_heads, block_size=cfg.block_size, window=cfg.window, dropout=cfg.dropout,
                       lookup=cfg.lookup)
    vocab = None
    if cfg.head_vocab == "train-labels":
        found = []
        for s in d.train:
            labels, valid = blocks.block_targets(s, blocks.valid_anchors(s["loss_mask"]), cfg.block_size, cfg.labels)
            found.append(labels[valid])
        vocab, counts = torch.unique(torch.cat(found), return_counts=True)
        if cfg.draft_vocab_size and len(vocab) > cfg.draft_vocab_size:  # the most frequent labels (ties: lower id)
            order = torch.argsort(counts, descending=True, stable=True)[: cfg.draft_vocab_size]
            vocab = vocab[order.sort().values]
    torch.manual_seed(cfg.seed)
    return Drafter(mcfg, d.embed, d.lm_head, vocab)


def _autocast(precision: str):
    if precision == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def block_loss(model: Drafter, batch: blocks.Batch, loss_decay: float, kl_weight: float = 0.0,
               precision: str = "float32") -> torch.Tensor:
    """Weighted cross-entropy toward the labels over the valid slots of ``batch`` (a float32 scalar),
    plus ``kl_weight`` times the cross-entropy against the target's top-K distribution (its ids the
    head scores, renormalized). Slot j weighs ``exp(-(j-1) / loss_decay)`` (all 1 when loss_decay is 0);
    labels outside the model's vocabulary are skipped."""
    Bm1 = model.cfg.block_size - 1
    index = model.column
    cols = index[batch.labels]
    valid = batch.valid & (cols >= 0) & (batch.anchors >= 0)[..., None]
    w = torch.exp(-torch.arange(Bm1, dtype=torch.float32) / loss_decay) if loss_decay else torch.ones(Bm1)
    w = w * valid  # [S, M, B-1]
    rows = w > 0
    with _autocast(precision):
        look = batch.lookup[rows] if batch.lookup is not None else None
        logits = model.logits(model(batch)[rows], look).float()  # [R, V']
    logp = F.log_softmax(logits, dim=-1)
    loss = -(logp.gather(1, cols[rows][:, None])[:, 0] * w[rows])
    if kl_weight:
        tcols = index[batch.topk_ids[rows]]  # [R, K]
        tlp = torch.where(tcols >= 0, batch.topk_logprobs[rows], -float("inf"))
        teacher = torch.softmax(tlp, dim=-1)  # renormalized over the scored ids
        soft = -(teacher * logp.gather(1, tcols.clamp(min=0))).sum(-1)
        loss = loss + kl_weight * soft * w[rows]
    return loss.sum() / w.sum().clamp(min=1e-9)


def anchor_rows(seqs: list[dict], per_row: int, limit: int = 0) -> list[tuple[int, torch.Tensor]]:
    """(conversation index, anchors) rows covering every valid anchor of ``seqs``, or ``limit`` of them
    evenly spaced over the whole set (0: all), at most ``per_row`` anchors a row."""
    every = [(i, blocks.valid_anchors(s["loss_mask"])) for i, s in enumerate(seqs)]
    total = sum(len(a) for _, a in every)
    if limit and total > limit:
        pick = torch.arange(limit) * total // limit  # global anchor numbers, increasing
        start, kept = 0, []
        for i, a in every:
            sel = pick[(pick >= start) & (pick < start + len(a))] - start
            kept.append((i, a[sel]))
            start += len(a)
        every = kept
    return [(i, r) for i, a in every for r in blocks.rows_of(a, per_row)]


def batches(seqs: list[dict], rows: list[tuple[int, torch.Tensor]], rows_per_batch: int, block_size: int,
            labels: str = "argmax", topk: bool = False, lookup: int = 0):
    """:class:`blocks.Batch` es of ``rows_per_batch`` rows, in order."""
    for start in range(0, len(rows), rows_per_batch):
        part = rows[start:start + rows_per_batch]
        yield blocks.make_batch([seqs[i] for i, _ in part], [a for _, a in part], block_size, labels, topk, lookup)


@torch.no_grad()
def evaluate(model: Drafter, seqs: list[dict], rows: list[tuple[int, torch.Tensor]], rows_per_batch: int = 8,
             precision: str = "float32") -> dict:
    """Offline score of ``model`` on the anchors ``rows`` of ``seqs`` against the target's greedy tokens
    (:mod:`drafter.metrics`): accept_len, accept_len_with_bonus, first_token_acc, position_acc, blocks."""
    model.eval()
    score = metrics.Score()
    for batch in batches(seqs, rows, rows_per_batch, model.cfg.block_size, lookup=model.cfg.lookup):
        real = batch.anchors >= 0
        with _autocast(precision):
            pred = model.vocab[model.logits(model(batch), batch.lookup).float().argmax(-1)]
        score.add(pred[real], batch.labels[real], batch.valid[real])
    return score.as_dict()


def evaluate_bigram(train: list[dict], held: list[dict], rows: list[tuple[int, torch.Tensor]], block_size: int,
                    vocab_size: int) -> dict:
    """The bigram baseline fitted on the train split's anchors, scored like :func:`evaluate`: from the
    anchor token ``x_a``, chained ``B-1`` steps."""
    cur = torch.cat([s["input_ids"][blocks.valid_anchors(s["loss_mask"])] for s in train])
    nxt = torch.cat([s["argmax"][blocks.valid_anchors(s["loss_mask"])] for s in train])
    table = metrics.fit_bigram(cur, nxt, torch.arange(len(cur)), vocab_size)
    score = metrics.Score()
    for i, a in rows:
        labels, valid = blocks.block_targets(held[i], a, block_size, "argmax")
        score.add(metrics.bigram_draft(table, held[i]["input_ids"][a], block_size - 1), labels, valid)
    return score.as_dict()


def evaluate_lookup(held: list[dict], rows: list[tuple[int, torch.Tensor]], block_size: int, n: int = 2) -> dict:
    """The prompt-lookup baseline (:func:`drafter.metrics.lookup_draft`, bigram match), scored like
    :func:`evaluate`; it trains on nothing."""
    score = metrics.Score()
    for i, a in rows:
        labels, valid = blocks.block_targets(held[i], a, block_size, "argmax")
        score.add(metrics.lookup_draft(held[i]["input_ids"], a, block_size, n), labels, valid)
    return score.as_dict()


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


class AnchorSampler:
    """Training rows drawn uniformly over the valid anchors of ``seqs``: a conversation with probability
    proportional to its anchors, then ``per_row`` of its anchors without replacement (all when fewer)."""

    def __init__(self, seqs: list[dict], per_row: int, generator: torch.Generator):
        self.anchors = [blocks.valid_anchors(s["loss_mask"]) for s in seqs]
        self.weights = torch.tensor([float(len(a)) for a in self.anchors])
        self.per_row, self.gen = per_row, generator

    def rows(self, n: int) -> list[tuple[int, torch.Tensor]]:
        picked = torch.multinomial(self.weights, n, replacement=True, generator=self.gen).tolist()
        out = []
        for i in picked:
            a = self.anchors[i]
            take = torch.randperm(len(a), generator=self.gen)[: self.per_row]
            out.append((i, a[take.sort().values]))
        return out


def train(cfg: TrainConfig, d: Data | None = None) -> dict:
    """Train a drafter as ``cfg`` says and write the outputs (module docstring) into ``cfg.out``.
    ``d``: preloaded data (:func:`load_data` with the same runs), else read here. Returns
    ``{"data", "untrained", "bigram", "drafter"}`` (held-out scores), ``fixed_loss`` before/after and
    ``seconds`` (training loop only). Rows are drawn with a generator seeded by ``cfg.seed``, so a run
    is reproducible on one machine. Raises CaptureError when ``out`` already holds a drafter."""
    out = Path(cfg.out)
    if (out / CHECKPOINT).exists():
        raise CaptureError(f"{out} already holds a trained drafter; train into another --out")
    if (out / MANIFEST).exists() or (out / MANIFEST_DIR).exists():
        raise CaptureError(f"{out} holds a capture run; train into another --out")
    d = d or load_data(cfg.run, cfg.heldout_fraction, cfg.target_dir, cfg.heldout_run, topk=cfg.kl_weight > 0,
                       online=cfg.online)
    if cfg.kl_weight and "topk_ids" not in d.train[0]:
        raise CaptureError(f"{cfg.run} stores no top-K logits (capture it with --topk K) but kl_weight > 0")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CaptureError(f"cannot create --out {out}: {e.strerror or e}") from None
    with open(out / METRICS, "w") as log:

        def emit(entry: dict) -> None:
            log.write(json.dumps(entry) + "\n")
            log.flush()

        return _train(cfg, d, out, emit)


def _train(cfg: TrainConfig, d: Data, out: Path, emit) -> dict:
    model = build_model(cfg, d)
    B, topk = cfg.block_size, cfg.kl_weight > 0
    result = {"data": d.summary()}
    emit({"kind": "data", **result["data"]})
    held = anchor_rows(d.heldout, cfg.anchors_per_seq, cfg.eval_anchors)
    gen = torch.Generator().manual_seed(cfg.seed)
    sampler = AnchorSampler(d.train, cfg.anchors_per_seq, gen)
    per_step = max(1, cfg.anchors_per_step // cfg.anchors_per_seq)
    n = model.cfg.lookup
    fixed = list(batches(d.train, sampler.rows(max(1, 1024 // cfg.anchors_per_seq)), per_step, B, cfg.labels, topk, n))

    def loss_of(batch):
        return block_loss(model, batch, cfg.loss_decay, cfg.kl_weight, cfg.precision)

    def fixed_loss() -> float:
        with torch.no_grad():
            return sum(float(loss_of(b)) for b in fixed) / len(fixed)

    result["untrained"] = evaluate(model, d.heldout, held, cfg.eval_rows, cfg.precision)
    result["bigram"] = evaluate_bigram(d.train, d.heldout, held, B, model.cfg.vocab_size)
    result["lookup"] = evaluate_lookup(d.heldout, held, B, cfg.lookup or 2)
    for name in ("untrained", "bigram", "lookup"):
        emit({"kind": "eval", "model": name, "split": "heldout", **result[name]})
    result["fixed_loss"] = [fixed_loss()]
    emit({"kind": "fixed_loss", "step": 0, "loss": result["fixed_loss"][0]})

    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"train seed {cfg.seed}", unit="step", disable=not cfg.progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        (batch,) = batches(d.train, sampler.rows(per_step), per_step, B, cfg.labels, topk, n)
        loss = loss_of(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            bar.set_postfix(loss=f"{loss.item():.3f}")
            emit({"kind": "train", "step": step + 1, "loss": loss.item(), "lr": _lr(cfg, step),
                  "seconds": round(time.perf_counter() - start, 2)})
    result["seconds"] = round(time.perf_counter() - start, 2)
    model.eval()
    result["fixed_loss"].append(fixed_loss())
    emit({"kind": "fixed_loss", "step": cfg.steps, "loss": result["fixed_loss"][1]})
    save_checkpoint(model, cfg, d, out)
    result["drafter"] = evaluate(model, d.heldout, held, cfg.eval_rows, cfg.precision)
    emit({"kind": "eval", "model": "drafter", "split": "heldout", "train_seconds": result["seconds"],
          **result["drafter"]})
    return result


def save_checkpoint(model: Drafter, cfg: TrainConfig, d: Data, out: str | os.PathLike) -> None:
    """Write ``model.safetensors``, ``config.json`` and ``train_set.npz`` into ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / CHECKPOINT))
    meta = {"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(model.cfg),
            "taps": data.tap_columns(d.header), "target": d.header.target,
            "tokenizer_sha256": d.header.tokenizer_sha256, "target_dir": str(d.target_dir),
            "embed_sha256": tensor_sha256(d.embed), "lm_head_sha256": tensor_sha256(d.lm_head)}
    (out / CONFIG).write_text(json.dumps(meta, indent=1) + "\n")
    np.savez(out / TRAIN_SET, **data.fingerprint(d.train))


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
    fraction defaults to the one it was trained with; ``limit`` anchors as in :func:`anchor_rows`,
    default the training config's ``eval_anchors``). Rows sharing a sample_id or a prompt with the
    drafter's training set are skipped and counted (``skipped_trained_on``), so a score never comes from
    trained-on conversations (``split="train"`` then scores nothing and is refused). Raises
    CaptureError when the run's taps differ from the checkpoint's or nothing is left to score."""
    model, meta = load_checkpoint(path, target_dir)
    header = data.run_header(run)
    if data.tap_columns(header) != meta["taps"] or header.hidden_size != model.cfg.hidden_size:
        raise CaptureError(f"{run} stores {data.tap_columns(header)} (hidden {header.hidden_size}); "
                           f"the drafter was trained on {meta['taps']} (hidden {model.cfg.hidden_size})")
    fraction = meta["train"]["heldout_fraction"] if heldout_fraction is None else heldout_fraction
    prints = dict(np.load(Path(path) / TRAIN_SET))
    samples, skipped = [], 0
    for s in data.load_samples(run, split, fraction):
        if data.seen(s, prints):
            skipped += 1
        else:
            samples.append(s)
    if not samples:
        raise CaptureError(f"{run}: no {split} conversations to score at heldout_fraction {fraction} "
                           f"({skipped} skipped: the drafter was trained on them)")
    train_cfg = meta["train"]
    rows = anchor_rows(samples, train_cfg["anchors_per_seq"], train_cfg["eval_anchors"] if limit is None else limit)
    score = evaluate(model, samples, rows, train_cfg["eval_rows"], train_cfg["precision"])
    return {"split": split, "conversations": len(samples), "skipped_trained_on": skipped, **score}
