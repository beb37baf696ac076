"""Train while the capture runs: ``capture drafter train --online CAPTURE.yaml`` (rows straight from the
capture's Ray replicas) or ``--follow`` (a run a capture is still writing to disk: tail mode).

The trainer takes the rows one conversation at a time, in arrival order, and steps as soon as a batch is
full: the first optimizer step comes while the capture is still running, and memory is bounded as in the
offline trainer (:mod:`drafter.train`) plus the held-out set below. One pass: each row is trained once.

- **Online** (:func:`capture.online.start`, on a thread of this process): each finished unit goes to
  this trainer's queue; :class:`shards.online.OnlineStream` decodes its rows.
- **Follow** (``--follow``, :class:`shards.stream.ShardStream` with ``tail=True``): each shard is read as
  its manifest line is committed, until the run's completion record; no commit for
  :data:`FOLLOW_TIMEOUT_S` seconds ends the training (its last checkpoint kept).

**Before the first step** the trainer needs a head vocabulary, and nothing has been captured yet: it is
read from the labels of the first ``vocab_warmup`` train conversations (held in memory until then, then
trained on first). A held-out label outside it is a miss, as offline.

**Held out**: online, rows in the held-out split (:func:`drafter.data.heldout`) are kept aside as they
arrive, until ``eval_anchors`` anchors are held (later ones are counted and dropped); a train row sharing a
sample_id or prompt with a kept held-out row is skipped, and a held-out row sharing one with a row already
trained on is dropped. A followed run is scored on ``heldout_run`` (required: a run with ``--retain``
deletes shards once their train rows are acked), whose rows' ids and prompts no train row may share.
The untrained drafter, the bigram baseline (fitted on the rows trained on) and prompt lookup are scored
with the drafter at the end.

**Exactly once**: after each checkpoint the trainer acks what it covers. Online, by sample id
(:meth:`OnlineStream.ack`); a trainer started again with the same ``--out`` loads the latest checkpoint,
acks its rows again (a kill between a checkpoint and its ack loses nothing) before it starts the capture,
and the new capture of the same folder delivers every row not acked (held-out rows included, which are
never acked, and rows trained after the checkpoint) and none that is. Followed, by stream position
(:meth:`ShardStream.ack`, what ``--retain`` deletes by); a restarted trainer continues from the position
its checkpoint saved.

**Waits**: the result reports ``trainer_waited_s`` (the trainer blocked on rows: the capture is the
bottleneck) and, online, ``capture_waited_s`` (the capture blocked on a full queue: the trainer is).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from common.errors import CaptureError
from drafter import blocks, checkpoint, data, evaluate, metrics
from drafter.config import TrainConfig
from drafter.model import load_target_head
from drafter.train import (FIXED_ANCHORS, METRICS, SAMPLES, Logs, block_loss, build_model, check_compatible, locked_out,
                           default_target_dir, optimizer, result_of, resumable, train_step)
from shards import live
from shards.run import resolve
from shards.stream import ShardStream

log = logging.getLogger(__name__)


FOLLOW_TIMEOUT_S = 900.0  # --follow: no new commit for this long and the capture is taken for dead


@dataclasses.dataclass
class Source:
    """Where a live trainer's rows come from. ``stream``: samples in arrival order (``.header``,
    ``.wait_seconds``); ``state(taken)``: what a checkpoint saves of the stream, given the number of samples
    taken from it (in this process) up to the last one trained on (None: nothing, the capture keeps count);
    ``ack(ids, state)``: after that checkpoint is written, with the sample ids it covers; ``held``: a finished
    held-out run and its :class:`drafter.data.Scan`, or None (held-out rows come from the stream); ``drain``:
    read the stream to its end once the steps are done (an online capture waits on its queue otherwise)."""

    name: str
    stream: Any
    state: Callable[[int], dict | None]
    ack: Callable[[list[str], dict | None], None]
    held: tuple[str, data.Scan] | None = None
    drain: bool = False


def train(cfg: TrainConfig) -> dict:
    """Train on the rows of a live capture as they arrive (module docstring): ``cfg.online`` or
    ``cfg.follow``. Writes what :func:`drafter.train.train` writes; returns its result plus
    ``trainer_waited_s``, ``first_step_s`` (seconds from the start to the first optimizer step) and, online,
    ``capture_waited_s``, ``capture_s`` (to the capture's end) and ``capture`` (its summary). Raises
    CaptureError as the capture does, for a run that cannot train a drafter, when every row was acked by an
    earlier trainer, or when no commit arrives for :data:`FOLLOW_TIMEOUT_S` seconds."""
    with locked_out(cfg) as out:
        resume = checkpoint.latest(out)
        if resume is not None:
            resumable(checkpoint.read_state(resume), cfg, 1, resume)
        return _online(cfg, out, resume) if cfg.online else _follow(cfg, out, resume)


def _online(cfg: TrainConfig, out: Path, resume: Path | None) -> dict:
    from capture import online
    from capture.config import from_mapping, load_yaml

    capture_cfg = from_mapping({**load_yaml(str(cfg.online)), "progress": False})
    if resume is not None:  # before the capture starts: it skips what the checkpoint covers, acked or not yet
        trained = tuple(checkpoint.load_extra(resume)["trained_ids"])
        live.write(resolve(capture_cfg.out), live.Ack("online", 0, 1, time.time(), sample_ids=trained))
    begin = time.perf_counter()
    run = online.start(capture_cfg)
    try:
        stream = run.stream(0, final=False, topk=cfg.kl_weight > 0)
        source = Source(str(cfg.online), stream, state=lambda taken: None, ack=lambda ids, _: stream.ack(ids),
                        drain=True)
        result = _train(cfg, out, source, begin)
        summary = run.join()
    finally:
        run.close()
    result.update(capture_waited_s=round(run.trainer_wait_s, 2), capture=summary,
                  capture_s=round(run.ended_at - begin, 2) if run.ended_at else None)
    return result


def _follow(cfg: TrainConfig, out: Path, resume: Path | None) -> dict:
    if not cfg.heldout_run:
        raise CaptureError("--follow needs --heldout-run: a followed run's own held-out rows may be removed "
                           "(--retain) before it completes")
    begin = time.perf_counter()
    held_header = data.run_header(cfg.heldout_run)
    stream = ShardStream(cfg.run, split="all", final=False, topk=cfg.kl_weight > 0, tail=True, rank=0,
                         world_size=1, timeout_s=FOLLOW_TIMEOUT_S)
    check_compatible(cfg.run, data.check_header(stream.header, cfg.run), cfg.heldout_run, held_header)
    if resume is not None:
        stream.load_state_dict(checkpoint.read_state(resume)["streams"][0])
    vocab = load_target_head(Path(cfg.target_dir) if cfg.target_dir else default_target_dir(cfg.run))[0].shape[0]
    held = data.scan(cfg.heldout_run, "all", 0.0, cfg.block_size, vocab)

    # acks by position: what --retain may delete are the shards this rank is done with
    source = Source(cfg.run, stream, state=lambda taken: stream.state_dict(consumed=taken),
                    ack=lambda ids, state: stream.ack(state), held=(cfg.heldout_run, held))
    return _train(cfg, out, source, begin)


def _train(cfg: TrainConfig, out: Path, src: Source, begin: float) -> dict:
    stream = src.stream
    header = data.check_header(stream.header, cfg.run)
    if cfg.kl_weight and not header.topk:
        raise CaptureError(f"{src.name} captures no top-K logits (capture with --topk K) but kl_weight > 0")
    tdir = Path(cfg.target_dir) if cfg.target_dir else default_target_dir(cfg.run)
    embed, lm_head = load_target_head(tdir)
    V, B = embed.shape[0], cfg.block_size
    per_step = max(1, cfg.anchors_per_step // cfg.anchors_per_seq)
    resume = checkpoint.latest(out)
    saved = checkpoint.load_extra(resume) if resume is not None else {}
    held, held_ids, held_keys = [], set(), set()
    trained_ids, trained_keys = set(saved.get("trained_ids", ())), set(saved.get("trained_keys", ()))
    bigram = metrics.BigramCounts.from_state(saved["bigram"]) if saved else metrics.BigramCounts(V)
    count = {"held_anchors": 0, "dropped": 0, "taken": 0, "waited": 0.0}

    def arrivals():
        """Train conversations with their anchors and arrival number (``"taken"``: samples taken from the
        stream up to it); held-out ones go to ``held`` (online) or are dropped (a held-out run's)."""
        samples = iter(stream)
        while True:
            t0 = time.perf_counter()
            sample = next(samples, None)
            count["waited"] += time.perf_counter() - t0
            if sample is None:
                return
            count["taken"] += 1
            conv = data.prepare(sample)
            sid, key = conv["sample_id"], conv["prompt_key"]
            if src.held is not None:
                if data.seen(conv, src.held[1].prints):
                    count["dropped"] += 1
                    continue
            elif data.heldout(sid, cfg.heldout_fraction):
                full = cfg.eval_anchors and count["held_anchors"] >= cfg.eval_anchors
                if full or sid in trained_ids or key in trained_keys:
                    count["dropped"] += 1
                else:
                    held.append(conv)
                    held_ids.add(sid)
                    held_keys.add(key)
                    count["held_anchors"] += len(blocks.valid_anchors(conv["loss_mask"]))
                continue
            if sid in held_ids or key in held_keys:
                count["dropped"] += 1
                continue
            conv["anchors"] = data.pick_anchors(conv["loss_mask"], cfg.anchors_per_seq, cfg.seed, 0, sid)
            conv["taken"] = count["taken"]
            if len(conv["anchors"]):
                yield conv

    items = arrivals()
    warm = list(itertools.islice(items, max(cfg.vocab_warmup, per_step)))
    if not warm:
        raise CaptureError(f"{src.name}: the capture delivered no train conversation (rows acked by an earlier "
                           "trainer are not delivered again: give the capture another out)")
    if resume is not None:  # the head's vocabulary is the checkpoint's
        counts = np.zeros(V, dtype=np.int64)
        counts[saved["vocab"].numpy()] = 1
    else:
        counts = data.scan_rows(((c["sample_id"], c["input_ids"], c["loss_mask"], c["argmax"]) for c in warm),
                                B, V, cfg.labels).label_counts
    model = build_model(cfg, header, embed, lm_head, counts)
    untrained = copy.deepcopy(model.state_dict())
    opt = optimizer(cfg, model)
    first, n = [], 0  # the fixed-loss conversations: the first ones, up to FIXED_ANCHORS anchors
    for c in warm:
        if n >= FIXED_ANCHORS:
            break
        first.append(c)
        n += len(c["anchors"])
    fixed = [blocks.make_batch(part, [c["anchors"] for c in part], B, cfg.labels, cfg.kl_weight > 0, cfg.lookup)
             for part in (first[i:i + per_step] for i in range(0, len(first), per_step))]

    def fixed_loss() -> float:
        with torch.no_grad():
            return sum(float(block_loss(model, b, cfg.loss_decay, cfg.kl_weight, cfg.precision))
                       for b in fixed) / len(fixed)

    step = 0
    if resume is not None:
        state, _ = checkpoint.load_state(resume, model, opt)
        step = state["step"]
        log.info("resuming %s from its checkpoint of step %d (%s)", out, step, resume.name)
    logs = Logs(out, 0, state["logs"] if resume is not None else None)
    if resume is None:
        logs.write(METRICS, {"kind": "fixed_loss", "step": 0, "loss": fixed_loss()})

    def save(step: int, unacked: list[str], taken: int) -> None:
        extra = {"trained_ids": sorted(trained_ids), "trained_keys": sorted(trained_keys), "bigram": bigram.state(),
                 "vocab": model.vocab.clone()}
        position = src.state(taken)
        checkpoint.save_state(out, step, model, opt, [torch.get_rng_state()],
                              {"streams": [position] if position else [], "world_size": 1, "logs": logs.lengths(),
                               "config": dataclasses.asdict(cfg)}, extra)
        try:
            src.ack(unacked, position)  # after the checkpoint that covers them: a restarted capture skips them
        except OSError as e:  # the run's disk (tail acks) or the capture's queue: the checkpoint stands
            raise CaptureError(f"the checkpoint of step {step} is saved but its ack to {src.name} could not be "
                               f"written ({e.strerror or e}); rerun the same command: it resumes from that "
                               "checkpoint and acks again") from None

    pending, unacked, first_step, taken = [], [], None, 0
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train seed {cfg.seed} (live)", unit="step",
               disable=not cfg.progress)
    start = time.perf_counter()
    for conv in itertools.chain(warm, items):
        if step >= cfg.steps:
            break
        pending.append(conv)
        if len(pending) < per_step:
            continue
        loss = train_step(model, opt, pending, cfg, step)
        if first_step is None:
            first_step = round(time.perf_counter() - begin, 2)
            log.info("first optimizer step %.1f s after the start, %d conversations in", first_step, count["taken"])
        for c in pending:
            trained_ids.add(c["sample_id"])
            trained_keys.add(c["prompt_key"])
            a = blocks.valid_anchors(c["loss_mask"])
            bigram.add(c["input_ids"][a], c["argmax"][a])
        logs.write(SAMPLES, {"step": step + 1, "samples": [[0, 0, c["sample_id"]] for c in pending]})
        unacked += [c["sample_id"] for c in pending]
        taken = pending[-1]["taken"]
        pending, step = [], step + 1
        bar.update(1)
        if step % cfg.log_every == 0:
            logs.write(METRICS, {"kind": "train", "step": step, "loss": loss,
                                 "seconds": round(time.perf_counter() - start, 2), "waited_s": round(count["waited"], 2)})
        if step % cfg.checkpoint_every == 0:
            save(step, unacked, taken)
            unacked = []
    if src.drain:  # the steps are done: what still arrives is not trained on (nor acked: a later run gets it)
        for _ in items:
            pass
    bar.close()
    if not step:
        raise CaptureError(f"{src.name}: fewer than {per_step} train conversations arrived: no step was made")
    if unacked or not (out / checkpoint.STATES).is_dir():
        save(step, unacked, taken)
    seconds = round(time.perf_counter() - start, 2)
    if src.held is not None:
        held_scan = src.held[1]

        def rows():
            return evaluate.heldout_rows(src.held[0], "all", 0.0, held_scan, cfg.anchors_per_seq, cfg.eval_anchors)
    else:
        if not held:
            raise CaptureError(f"{src.name}: no held-out conversation arrived (heldout_fraction {cfg.heldout_fraction})")
        held_scan = data.scan_rows(((c["sample_id"], c["input_ids"], c["loss_mask"], c["argmax"]) for c in held), B, V)

        def rows():
            picks = evaluate.select_anchors(held_scan.anchors_each, cfg.eval_anchors)
            for conv, pick in zip(held, picks):
                for row in blocks.rows_of(blocks.valid_anchors(conv["loss_mask"])[pick], cfg.anchors_per_seq):
                    yield conv, row

    model.eval()
    logs.write(METRICS, {"kind": "fixed_loss", "step": step, "loss": fixed_loss()})
    logs.write(METRICS, {"kind": "data", "train": {"conversations": len(trained_ids)},
                         "precision": evaluate.resolve_precision(cfg.precision),
                         "heldout": held_scan.summary(), "overlap_removed": count["dropped"]})
    trained = {"sample_ids": np.unique(np.array([data.id_hash(i) for i in trained_ids], dtype=np.uint64)),
               "prompt_keys": np.unique(np.array([int(k, 16) for k in trained_keys], dtype=np.uint64))}
    checkpoint.save(model, checkpoint.meta(cfg, header, tdir, embed, lm_head), trained, out)
    scores = evaluate.score(rows(), B, model, bigram.table(), cfg.lookup or 2, cfg.eval_rows, cfg.precision)
    trained_state = copy.deepcopy(model.state_dict())
    model.load_state_dict(untrained)
    base = evaluate.score(rows(), B, model, rows_per_batch=cfg.eval_rows, precision=cfg.precision)["drafter"]
    model.load_state_dict(trained_state)
    for name, entry in (("untrained", base), ("bigram", scores["bigram"]), ("lookup", scores["lookup"]),
                        ("drafter", {"train_seconds": seconds, **scores["drafter"]}),
                        *((name, scores.get(name)) for name in evaluate.BLOCK_CHOICES)):
        if entry is not None:
            logs.write(METRICS, {"kind": "eval", "model": name, "split": "heldout", **entry})
    logs.close()
    return {**result_of(out / METRICS), "seconds": seconds, "first_step_s": first_step,
            "trainer_waited_s": round(count["waited"], 2)}
