"""Train a drafter on a capture run, streamed: bounded memory at any run size, exact resume, several ranks.

The loop, read top to bottom in :func:`train`:

1. **Scan** (:func:`prepare`): one pass over the held-out set and one over the train split reading ids,
   masks and argmax only (:func:`drafter.data.scan`): counts, the head's vocabulary (the train labels),
   the bigram baseline, the fingerprints that keep the two sets apart. No state is decoded.
2. **Stream**: a :class:`shards.stream.ShardStream` of the train split, shuffled by ``(seed, epoch)``,
   split over ``torch.distributed`` ranks, read by ``workers`` DataLoader processes that decode and
   normalize each conversation and draw its anchors (:class:`drafter.data.Conversations`). A step takes
   the next ``anchors_per_step // anchors_per_seq`` conversations of its rank (one batch row each); an
   epoch that ends mid-batch continues with the next epoch's order, so every rank makes the same steps.
   Memory: the stream's shuffle buffer holds shard/row numbers, its workers a few decoded conversations,
   the trainer one batch.
3. **Step**: the block loss (:func:`block_loss`), gradients averaged over the ranks (one ``all_reduce``
   a parameter: what DDP does, without its bucketing), clipped to norm 1, AdamW with warm-up and cosine.
4. **Checkpoint** every ``checkpoint_every`` steps and at the end (:mod:`drafter.checkpoint`: model,
   optimizer, RNG, every rank's stream position, written by rank 0). A trainer started again with the
   same ``--out`` continues from the latest one: the rest of each epoch in the same order, every row
   once, the same steps as a run never stopped.
5. **Score** on rank 0 (:mod:`drafter.evaluate`): the untrained drafter, the bigram and prompt-lookup
   baselines before training, the drafter after.

Files in ``cfg.out``: the trained drafter (:mod:`drafter.checkpoint`), ``metrics.jsonl`` (one JSON object
a line: ``data``, ``eval`` for each model scored, ``fixed_loss`` before and after, ``train`` every
``log_every`` steps) and ``samples.jsonl`` (per step, ``[rank, epoch, sample_id]`` of each conversation
trained on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

from common.errors import CaptureError
from drafter import blocks, checkpoint, data, evaluate
from drafter.config import TrainConfig
from drafter.model import Drafter, ModelConfig, load_target_head
from shards.format import RunHeader
from shards.run import MANIFEST, MANIFEST_DIR, as_location
from shards.stream import ShardStream

log = logging.getLogger(__name__)
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
FIXED_ANCHORS = 1024  # anchors of the fixed train batches whose loss is logged before and after training


@dataclasses.dataclass
class Setup:
    """What training needs besides the stream: the run header, the target's frozen tensors, and the
    :class:`drafter.data.Scan` of each set (``held``: of ``held_source``, ``(run, split, fraction)``)."""

    header: RunHeader
    target_dir: Path
    embed: torch.Tensor  # [V, H], the stored dtype
    lm_head: torch.Tensor  # [V, H]
    train: data.Scan
    held: data.Scan
    train_source: tuple[str, str, float]
    held_source: tuple[str, str, float]
    only: dict[str, np.ndarray] | None = None  # train_rows/anchors: the fingerprint of the rows trained on, else None

    def summary(self) -> dict:
        return {"train": self.train.summary(), "heldout": self.held.summary(), "overlap_removed": self.train.removed}


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


def prepare(cfg: TrainConfig) -> Setup:
    """Check the runs and scan both sets (module docstring, step 1). Held out: every row of
    ``cfg.heldout_run`` when given (then ``cfg.run`` trains whole), else ``cfg.run``'s held-out split.
    ``cfg.train_rows`` N > 0: only the first N train conversations (manifest order) are trained on;
    ``cfg.train_anchors`` N > 0: only the first train conversations that together hold N valid anchors
    (the shortest such prefix; with both, whichever ends first).
    Raises CaptureError when either set is empty, the runs differ in taps or tokenizer, the run lacks the
    top-K a ``kl_weight`` needs, or the target folder has no matching embeddings."""
    header = data.run_header(cfg.run)
    if cfg.kl_weight and not header.topk:
        raise CaptureError(f"{cfg.run} stores no top-K logits (capture it with --topk K) but kl_weight > 0")
    tdir = Path(cfg.target_dir) if cfg.target_dir else default_target_dir(cfg.run)
    embed, lm_head = load_target_head(tdir)
    if embed.shape[1] != header.hidden_size:
        raise CaptureError(f"{tdir}: hidden size {embed.shape[1]} but the run stores {header.hidden_size}")
    if cfg.heldout_run:
        check_compatible(cfg.run, header, cfg.heldout_run, data.run_header(cfg.heldout_run))
        held_source, train_source = (cfg.heldout_run, "all", 0.0), (cfg.run, "all", 0.0)
        where = f"{cfg.heldout_run} (all rows)"
    else:
        held_source = (cfg.run, "heldout", cfg.heldout_fraction)
        train_source = (cfg.run, "train", cfg.heldout_fraction)
        where = f"heldout_fraction {cfg.heldout_fraction}"
    V = embed.shape[0]
    held = data.scan(*held_source, cfg.block_size, V)
    train = data.scan(*train_source, cfg.block_size, V, cfg.labels, exclude=held.prints, limit=cfg.train_rows,
                      anchor_limit=cfg.train_anchors)
    if not train.conversations or not held.conversations:
        raise CaptureError(f"{cfg.run}: {train.conversations} train and {held.conversations} held-out conversations "
                           f"({where}); both sets need at least one: capture more rows or change --heldout-fraction")
    return Setup(header, tdir, embed, lm_head, train, held, train_source, held_source,
                 train.prints if cfg.train_rows or cfg.train_anchors else None)


def build_model(cfg: TrainConfig, header: RunHeader, embed: torch.Tensor, lm_head: torch.Tensor,
                label_counts: np.ndarray) -> Drafter:
    """A freshly initialized drafter (``torch.manual_seed(cfg.seed)`` first, so the same seed gives the
    same weights). Its vocabulary is the ids with a nonzero ``label_counts`` (int64 [V], the train labels;
    the ``cfg.draft_vocab_size`` most frequent of them, ties to the lower id, when set) or the full one
    (``cfg.head_vocab``)."""
    mcfg = ModelConfig(num_taps=len(data.tap_columns(header)), hidden_size=header.hidden_size,
                       vocab_size=embed.shape[0], d_model=cfg.d_model, n_layers=cfg.n_layers,
                       n_heads=cfg.n_heads, block_size=cfg.block_size, window=cfg.window, dropout=cfg.dropout,
                       lookup=cfg.lookup)
    vocab = None
    if cfg.head_vocab == "train-labels":
        counts = torch.from_numpy(label_counts)
        vocab = torch.nonzero(counts).flatten()
        if cfg.draft_vocab_size and len(vocab) > cfg.draft_vocab_size:
            order = torch.argsort(counts[vocab], descending=True, stable=True)[: cfg.draft_vocab_size]
            vocab = vocab[order.sort().values]
    torch.manual_seed(cfg.seed)
    return Drafter(mcfg, embed, lm_head, vocab)


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
    with evaluate.autocast(precision):
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


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer(cfg: TrainConfig, model: Drafter) -> torch.optim.AdamW:
    """AdamW over the drafter's trainable parameters (``lr`` set per step by :func:`train_step`)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                             weight_decay=cfg.weight_decay)


def train_step(model: Drafter, opt: torch.optim.Optimizer, convs: list[dict], cfg: TrainConfig, step: int,
               world: int = 1) -> float:
    """One optimizer step on the batch of ``convs`` (conversations with their ``anchors``, one batch row
    each): the learning rate of ``step`` (0-based), :func:`block_loss`, gradients averaged over ``world``
    ranks (an ``all_reduce`` a parameter), clipped to norm 1. Returns the loss (float)."""
    for group in opt.param_groups:
        group["lr"] = _lr(cfg, step)
    batch = blocks.make_batch(convs, [c["anchors"] for c in convs], cfg.block_size, cfg.labels, cfg.kl_weight > 0,
                              cfg.lookup)
    loss = block_loss(model, batch, cfg.loss_decay, cfg.kl_weight, cfg.precision)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in opt.param_groups for p in group["params"]]
    if world > 1:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss.item()


def _world() -> tuple[int, int]:
    """(rank, world size): ``torch.distributed``'s, initializing it (gloo on CPU) when ``torchrun`` set
    ``WORLD_SIZE`` > 1; else (0, 1)."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _fixed_batches(cfg: TrainConfig, s: Setup, per_step: int) -> Iterator[blocks.Batch]:
    """The first train conversations in manifest order, anchors drawn for "epoch" -1, up to
    :data:`FIXED_ANCHORS` anchors, as batches of ``per_step`` rows: the loss logged before and after
    training. Streamed again at each call (one batch held at a time)."""
    run, split, fraction = s.train_source
    stream = ShardStream(run, split=split, heldout_fraction=fraction, final=False, topk=cfg.kl_weight > 0, rank=0,
                         world_size=1)
    stream.epoch = -1  # anchors of their own, not those of a training epoch
    part, n = [], 0
    for conv in data.Conversations(stream, cfg.anchors_per_seq, cfg.seed, s.held.prints, s.only):
        if "skip" in conv:
            continue
        part.append(conv)
        n += len(conv["anchors"])
        if len(part) == per_step or n >= FIXED_ANCHORS:
            yield blocks.make_batch(part, [c["anchors"] for c in part], cfg.block_size, cfg.labels,
                                    cfg.kl_weight > 0, cfg.lookup)
            part = []
        if n >= FIXED_ANCHORS:
            return
    if part:
        yield blocks.make_batch(part, [c["anchors"] for c in part], cfg.block_size, cfg.labels, cfg.kl_weight > 0,
                                cfg.lookup)


LOCK = ".drafter.lock"


@contextlib.contextmanager
def locked_out(cfg: TrainConfig, rank: int = 0) -> Iterator[Path]:
    """``cfg.out``, created, writable and, for rank 0, locked (``.drafter.lock``, released on exit or by the
    OS if the process dies) while the block runs. Raises CaptureError when it holds a trained drafter or a
    capture run, cannot be written, or another trainer holds it."""
    from filelock import FileLock, Timeout

    out = Path(cfg.out)
    if (out / checkpoint.CHECKPOINT).exists():
        raise CaptureError(f"{out} already holds a trained drafter (score it with `capture drafter eval {out}`); "
                           "train into another --out")
    if (out / MANIFEST).exists() or (out / MANIFEST_DIR).exists():
        raise CaptureError(f"{out} holds a capture run; train into another --out")
    lock = FileLock(str(out / LOCK))
    try:
        out.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            lock.acquire(timeout=0)
    except Timeout:
        raise CaptureError(f"another trainer is writing {out} (it holds {out / LOCK})") from None
    except OSError as e:
        raise CaptureError(f"cannot write --out {out}: {e.strerror or e}") from None
    try:
        yield out
    finally:
        if lock.is_locked:
            lock.release()


_RESUME_FREE = ("out", "progress", "workers", "checkpoint_every")  # settings a resume may change: same rows, same drafter


def _norm(key: str, value):
    """A setting as a resume compares it: local folders by their resolved path."""
    if key in ("run", "heldout_run", "target_dir", "online") and isinstance(value, str) and "://" not in value:
        return os.path.realpath(value)
    return value


def resumable(saved: dict, cfg: TrainConfig, world: int, folder: Path) -> None:
    """Raise CaptureError unless a training checkpoint was made by this config and world size."""
    mine = dataclasses.asdict(cfg)
    diff = [k for k, v in saved["config"].items() if k not in _RESUME_FREE and _norm(k, mine.get(k)) != _norm(k, v)]
    if diff:
        raise CaptureError(f"{folder} was trained with other settings ({', '.join(diff)}); resume with the same "
                           "ones or train into another --out")
    if saved["world_size"] != world:
        raise CaptureError(f"{folder} was saved by {saved['world_size']} rank(s), this trainer has {world}: resume "
                           "with the same world size")


class Logs:
    """``metrics.jsonl`` and ``samples.jsonl``, appended by rank 0 only; cut back to a checkpoint's lengths
    on resume, so that they hold each step once."""

    def __init__(self, out: Path, rank: int, lengths: dict | None):
        self.files = {}
        if rank != 0:
            return
        for name in (METRICS, SAMPLES):
            keep = lengths.get(name, 0) if lengths else 0
            path = out / name
            if keep and (not path.exists() or path.stat().st_size < keep):
                raise CaptureError(f"{path} is shorter than at the checkpoint ({keep} bytes): it was cut or removed; "
                                   "train into another --out")
            f = open(path, "r+b" if keep else "wb")
            f.truncate(keep)
            f.seek(0, os.SEEK_END)
            self.files[name] = f

    def write(self, name: str, entry: dict) -> None:
        if name in self.files:
            self.files[name].write((json.dumps(entry) + "\n").encode())
            self.files[name].flush()

    def lengths(self) -> dict:
        return {name: f.tell() for name, f in self.files.items()}

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def train(cfg: TrainConfig) -> dict:
    """Train a drafter as ``cfg`` says, streamed (module docstring), and write the outputs into ``cfg.out``.
    Returns ``{"data", "untrained", "bigram", "lookup", "drafter"}`` and, with a lookup input,
    :data:`drafter.evaluate.BLOCK_CHOICES` (held-out scores, :func:`drafter.evaluate.score`), ``fixed_loss``
    before/after and ``seconds`` (the training loop of this process). Raises CaptureError when ``out``
    already holds a drafter or a run, or holds a checkpoint of other settings or another world size."""
    if cfg.online or cfg.follow:
        raise CaptureError("a live capture trains with drafter.live.train (the CLI picks it for --online/--follow)")
    rank, world = _world()
    with locked_out(cfg, rank) as out:
        return _train(cfg, out, rank, world)


def _train(cfg: TrainConfig, out: Path, rank: int, world: int) -> dict:
    resume = checkpoint.latest(out)
    if resume is not None:  # refused before any scan
        resumable(checkpoint.read_state(resume), cfg, world, resume)
    s = prepare(cfg)
    model = build_model(cfg, s.header, s.embed, s.lm_head, s.train.label_counts)
    opt = optimizer(cfg, model)
    per_step, topk = max(1, cfg.anchors_per_step // cfg.anchors_per_seq), cfg.kl_weight > 0
    run, split, fraction = s.train_source
    stream = ShardStream(run, split=split, heldout_fraction=fraction, final=False, topk=topk, shuffle=True,
                         seed=cfg.seed, shuffle_buffer=cfg.shuffle_buffer, rank=rank, world_size=world)

    def fixed_loss() -> float:
        with torch.no_grad():
            losses = [float(block_loss(model, b, cfg.loss_decay, cfg.kl_weight, cfg.precision))
                      for b in _fixed_batches(cfg, s, per_step)]
        return sum(losses) / len(losses)

    def held_rows():
        return evaluate.heldout_rows(*s.held_source, s.held, cfg.anchors_per_seq, cfg.eval_anchors)

    step = 0
    if resume is not None:
        state, rngs = checkpoint.load_state(resume, model, opt)
        stream.load_state_dict(state["streams"][rank])
        torch.set_rng_state(rngs[rank])
        step = state["step"]
        if rank == 0:
            log.info("resuming %s from its checkpoint of step %d (%s)", out, step, resume.name)
    logs = Logs(out, rank, state["logs"] if resume is not None else None)
    if resume is None and rank == 0:
        logs.write(METRICS, {"kind": "data", **s.summary(), "precision": evaluate.resolve_precision(cfg.precision)})
        scores = evaluate.score(held_rows(), cfg.block_size, model, s.train.bigram.table(), cfg.lookup or 2,
                                cfg.eval_rows, cfg.precision)
        for name, entry in (("untrained", scores["drafter"]), ("bigram", scores["bigram"]), ("lookup", scores["lookup"])):
            logs.write(METRICS, {"kind": "eval", "model": name, "split": "heldout", **entry})
        logs.write(METRICS, {"kind": "fixed_loss", "step": 0, "loss": fixed_loss()})

    loader = DataLoader(data.Conversations(stream, cfg.anchors_per_seq, cfg.seed, s.held.prints, s.only), batch_size=None,
                        num_workers=cfg.workers)
    model.train()
    items, consumed, trained_in_epoch = iter(loader), 0, 0
    pending: list[dict] = []
    start, waited = time.perf_counter(), 0.0
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train seed {cfg.seed}", unit="step",
               disable=not cfg.progress or rank != 0)
    while step < cfg.steps:
        t0 = time.perf_counter()
        try:
            item = next(items)
        except StopIteration:  # the epoch ended: the next one, in its own order
            if not trained_in_epoch and not pending:
                raise CaptureError(f"{run}: rank {rank} of {world} has no train conversation to read") from None
            stream.set_epoch(stream.epoch + 1)
            items, consumed, trained_in_epoch = iter(loader), 0, 0
            continue
        waited += time.perf_counter() - t0
        consumed += 1
        if "skip" in item:
            continue
        item["epoch"] = stream.epoch
        pending.append(item)
        trained_in_epoch += 1
        if len(pending) < per_step:
            continue
        loss = train_step(model, opt, pending, cfg, step, world)
        trained = _gather([[rank, c["epoch"], c["sample_id"]] for c in pending], world)
        logs.write(SAMPLES, {"step": step + 1, "samples": [x for part in trained for x in part]})
        pending, step = [], step + 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            bar.set_postfix(loss=f"{loss:.3f}")
            logs.write(METRICS, {"kind": "train", "step": step, "loss": loss, "lr": _lr(cfg, step - 1),
                                 "seconds": round(time.perf_counter() - start, 2),
                                 "waited_s": round(waited, 2)})
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            _save(out, step, model, opt, stream.state_dict(consumed=consumed), logs, cfg, rank, world)
    bar.close()
    seconds = round(time.perf_counter() - start, 2)
    if rank == 0:
        model.eval()
        logs.write(METRICS, {"kind": "fixed_loss", "step": cfg.steps, "loss": fixed_loss()})
        checkpoint.save(model, checkpoint.meta(cfg, s.header, s.target_dir, s.embed, s.lm_head), s.train.prints, out)
        scores = evaluate.score(held_rows(), cfg.block_size, model, rows_per_batch=cfg.eval_rows,
                                precision=cfg.precision)
        logs.write(METRICS, {"kind": "eval", "model": "drafter", "split": "heldout", "train_seconds": seconds,
                             "waited_s": round(waited, 2), **scores["drafter"]})
        for name in evaluate.BLOCK_CHOICES:
            if name in scores:
                logs.write(METRICS, {"kind": "eval", "model": name, "split": "heldout", **scores[name]})
    logs.close()
    if world > 1:
        dist.barrier()
    return {**result_of(out / METRICS), "seconds": seconds, "waited_s": round(waited, 2)}


def _save(out: Path, step: int, model: Drafter, opt, stream_state: dict, logs: Logs, cfg: TrainConfig,
          rank: int, world: int) -> None:
    """Every rank's stream state and RNG to rank 0, which writes the checkpoint; an error there is raised
    on every rank (one line each)."""
    streams, rngs = _gather(stream_state, world), _gather(torch.get_rng_state(), world)
    error = None
    if rank == 0:
        try:
            checkpoint.save_state(out, step, model, opt, rngs, {"streams": streams, "world_size": world,
                                                                "logs": logs.lengths(), "config": dataclasses.asdict(cfg)})
        except CaptureError as e:
            error = str(e)
    if world > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise CaptureError(error)


def result_of(metrics_path: Path) -> dict:
    """The result dict of a finished training from its ``metrics.jsonl``: ``data``, each ``eval`` model's
    scores under its name, ``fixed_loss`` [before, after]."""
    result, fixed = {}, []
    for line in Path(metrics_path).read_text().splitlines():
        entry = json.loads(line)
        kind = entry.pop("kind")
        if kind == "data":
            result["data"] = entry
        elif kind == "eval":
            name = entry.pop("model")
            entry.pop("split", None)
            entry.pop("train_seconds", None)
            entry.pop("waited_s", None)
            result[name] = entry
        elif kind == "fixed_loss":
            fixed.append(entry["loss"])
    result["fixed_loss"] = fixed
    return result


def evaluate_checkpoint(path: str | os.PathLike, run: str, split: str = "heldout",
                        heldout_fraction: float | None = None, limit: int | None = None,
                        target_dir: str | None = None) -> dict:
    """Score a saved drafter on ``run``'s ``split`` (``heldout``, ``train`` or ``all``; the held-out
    fraction defaults to the one it was trained with; ``limit`` anchors as in
    :func:`drafter.evaluate.select_anchors`, default the training config's ``eval_anchors``), streamed.
    Rows sharing a sample_id or a prompt with the drafter's training set are skipped and counted
    (``skipped_trained_on``), so a score never comes from trained-on conversations (``split="train"``
    then scores nothing and is refused). Raises CaptureError when the run's taps differ from the
    checkpoint's or nothing is left to score."""
    model, meta = checkpoint.load(path, target_dir)
    header = data.run_header(run)
    if data.tap_columns(header) != meta["taps"] or header.hidden_size != model.cfg.hidden_size:
        raise CaptureError(f"{run} stores {data.tap_columns(header)} (hidden {header.hidden_size}); "
                           f"the drafter was trained on {meta['taps']} (hidden {model.cfg.hidden_size})")
    if split not in data.SPLITS:
        raise CaptureError(f"unknown split {split!r} ({', '.join(data.SPLITS)})")
    fraction = meta["train"]["heldout_fraction"] if heldout_fraction is None else heldout_fraction
    prints = dict(np.load(Path(path) / checkpoint.TRAIN_SET))
    s = data.scan(run, split, fraction, model.cfg.block_size, model.cfg.vocab_size, exclude=prints)
    if not s.conversations:
        raise CaptureError(f"{run}: no {split} conversations to score at heldout_fraction {fraction} "
                           f"({s.removed} skipped: the drafter was trained on them)")
    train_cfg = meta["train"]
    rows = evaluate.heldout_rows(run, split, fraction, s, train_cfg["anchors_per_seq"],
                                 train_cfg["eval_anchors"] if limit is None else limit, exclude=prints)
    score = evaluate.score(rows, model.cfg.block_size, model, rows_per_batch=train_cfg["eval_rows"],
                           precision=train_cfg["precision"])["drafter"]
    return {"split": split, "conversations": s.conversations, "skipped_trained_on": s.removed, **score}
