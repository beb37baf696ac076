"""A capture run, start to end: plan → lock → executor → session → sink → replicas → finish.

1. :func:`capture.plan.prepare` resolves the config (target, taps, dataset, tokenizer, engine, run
   header) and :func:`capture.plan.check_out` what ``--out`` holds; every user error is raised there,
   before anything is written.
2. The run lock (:meth:`shards.run.Location.lock`): one writer per run.
3. :func:`capture.executor.start`: Ray actors or one replica in this process.
4. :meth:`capture.session.RunSession.open`: header, dataset and provenance; the session owns the
   manifest writer and the summary.
5. :func:`capture.sinks.of`: where finished rows go (shards, tail-retain, online delivery, tee).
6. The feed (:mod:`capture.work`: dataset rows → kept records → work units, skipping rows a resumed run
   holds) goes into a :class:`capture.pool.ReplicaPool` (two units queued per replica; a replica that
   dies or hangs is replaced and its uncommitted records handed out again); the pool hands every closed
   shard and payload to the sink. A unit is not sent when the disk could not hold it: the run stops.
7. :meth:`capture.session.RunSession.finish`: a clean stop, or the completion record.

Rerunning the same command resumes: sample ids already in the manifest are skipped before tokenization,
and the dedup filter is seeded with the committed token hashes. A run stops cleanly (everything
committed stays committed, no completion record) when the disk is about to fill or fills. ``--out`` may
name a run on any file system pyarrow supports (:mod:`shards.run`).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import time

from capture import executor as executor_mod
from capture import sinks
from capture.config import RunConfig
from capture.plan import bytes_per_token, check_out, estimate, prepare
from capture.pool import ReplicaPool
from capture.progress import Progress, Timings
from capture.session import RunSession
from capture.summary import Summary
from capture.work import records, units
from shards.run import LOCK


def run(cfg: RunConfig, delivery: sinks.Delivery | None = None) -> Summary:
    """Run (or resume, or extend) the capture described by ``cfg``; returns its :class:`Summary`.
    ``cfg.dry_run``: :func:`capture.plan.estimate` instead (writes nothing).

    ``delivery``: an online run (:mod:`capture.online`): replicas run on Ray and each unit's rows go to
    ``delivery.hand(info, payload, on_wait)`` (:class:`capture.sinks.Online`); with ``delivery.keep``
    they are also committed to shards exactly as offline.

    Raises CaptureError on user errors, on a conflicting existing run, when the disk fills (after a
    clean stop), and when no record at all could be kept.
    """
    if cfg.dry_run:
        return estimate(cfg)
    started = time.time()
    progress = Progress(cfg.progress)
    timings = Timings()
    try:
        progress.status("preparing: model, tokenizer, dataset")
        loc, _, prep = check_out(cfg, prepare(cfg))
        timings.prepare = time.time() - started
        busy = f"another capture is writing to {cfg.out} (it holds {LOCK}); wait for it or use another --out"
        with loc.lock(busy=busy), executor_mod.start(cfg, prep.engine, progress, delivery is not None) as ex:
            session = RunSession.open(cfg, prep, loc, started, timings, ex.name)
            sink = sinks.of(cfg, session, progress, delivery)
            return _capture(session, sink, ex, progress)
    finally:
        progress.close()


def _capture(session: RunSession, sink, ex: executor_mod.Executor, progress: Progress) -> Summary:
    """Feed the work units to the replicas until the dataset ends or the disk cannot hold the next unit;
    then :meth:`RunSession.finish`."""
    from capture import identity
    from capture.replica import Replica

    cfg, prep, summary, timings = session.cfg, session.prep, session.summary, session.timings
    ready = time.time()
    model = identity.of(prep.model_dir, prep.header.target.get("source"))  # every replica must find the same
    make_actor = ex.actors(Replica, prep.model_dir, prep.taps, prep.header, session.loc.absolute(),
                           shard_size=cfg.shard_size, batch_tokens=cfg.batch_tokens, threads=ex.cpus,
                           commit_seconds=cfg.commit_every, codec_threads=cfg.codec_threads, engine=prep.engine,
                           filters=cfg.filters, feed=progress.feed, output=sink.output, model=model)
    per_token = bytes_per_token(prep.header)
    rejected: collections.Counter = collections.Counter()
    prefilled = [0]  # rows through the engine (committed once their shard closes)

    def on_result(result) -> None:
        rejected.update(result.rejected.values())
        prefilled[0] += result.rows
        eta = _eta(time.time() - session.started, prefilled[0] + sum(rejected.values()), summary.kept,
                   summary.rows_read, cfg.limit)
        progress.postfix(rows=prefilled[0], committed=summary.committed_rows,
                         MiB=round(summary.committed_bytes / 2**20), **({"eta": eta} if eta else {}))
        progress.tick()

    stop: str | None = None
    pool = None
    try:
        pool = ReplicaPool(make_actor, cfg.replicas, sink=sink, on_result=on_result, calls=ex.calls,
                           unit_timeout=cfg.unit_timeout, max_attempts=cfg.max_unit_attempts, on_tick=progress.tick)
        seen = session.manifest.token_hashes() if cfg.filters.dedup else set()
        done = sink.done(session.loc, session.manifest)
        feed = records(cfg, prep.encoder, prep.dataset, prep.context_len, summary, done, seen)
        for unit in units(feed, cfg.unit_tokens, cfg.replicas, cfg.first_unit_tokens):
            need = sum(r.num_tokens for r in unit) * per_token * (cfg.replicas + 1) + cfg.disk_reserve
            free = session.loc.free_bytes() if sink.output.shards else None  # else rows never touch the disk
            if free is not None and free < need:
                stop = f"only {free / 2**20:.0f} MiB free at {cfg.out}, the next unit needs ~{need / 2**20:.0f} MiB"
                break
            pool.submit(unit)
        pool.finish()
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        stop = f"the disk at {cfg.out} is full ({e})"
    finally:
        progress.tick()
        if pool is not None:
            pool.close()
            summary.replicas = [dataclasses.asdict(s) for s in pool.stats]
            summary.quarantined = dict(pool.quarantined)
            timings.start = (ready - session.started - timings.prepare) + pool.start_seconds
            timings.engine = sum(s.engine_seconds for s in pool.stats)
            timings.write = sum(s.write_seconds for s in pool.stats)
        summary.timings = timings.as_dict()
        sink.close(summary)
    summary.rejected = dict(rejected)
    return session.finish(stop, progress, sink)


def _eta(elapsed: float, done: int, kept: int, rows_read: int, limit: int | None) -> str | None:
    """Time left as H:MM:SS when the rows to read are known (``--limit``): the records the engine will
    get are estimated as ``limit`` x the share of rows read so far that were kept, and the time left from
    the records it has done (``done``, rejected ones included); None otherwise. (The rows read run ahead
    of the engine by whole units, so they say nothing about the time left.)"""
    if not limit or not rows_read or not done:
        return None
    expected = max(kept, limit * kept / rows_read) if rows_read < limit else kept
    left = max(0.0, elapsed * (expected - done) / done)
    return time.strftime("%H:%M:%S", time.gmtime(left))

