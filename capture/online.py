"""Online runs: capture replicas stream their rows straight to the trainer through Ray; nothing is written
to disk but the run's small log (header, dataset, completion, provenance) and the trainer's acks.

:func:`start` runs the capture driver (:func:`capture.driver.run`, the same records, filters, replicas,
retries and exactly-once accounting as ``capture run``) on a thread of the calling process, with its Ray
replicas in stream mode: each completed work unit comes back as one Arrow IPC payload in Ray's object
store (:class:`shards.writer.StreamWriter`, the run codec's cells), owned by the driver. The driver hands
each payload's handle to one trainer rank's bounded queue (``ray.util.queue.Queue``, ``queue_units``
items; ranks in turn). :class:`shards.online.OnlineStream` is the trainer's side; the queue actors are
named, and ``online-endpoint.json`` in the run folder says where they are (written with the first unit,
or at the end of a run that delivers none), so ranks and DataLoader workers in other processes attach
with :func:`shards.online.attach`.

**Why a bounded queue of object refs** rather than Ray Data's ``streaming_split``: measured
(bench/online_transport.out, the same payloads from 2 producer actors to one consumer) it moved them
faster (0.68 vs 0.26 GB/s at 8 MiB units, 2.25 vs 1.52 at 64 MiB), with less CPU per GB and its first
payload 1.5-2 s sooner; and the replica pool already owns the retries of a dead replica and the
exactly-once accounting, which Ray Data's own actor pool and scheduling would duplicate.

**Backpressure.** While a rank's queue is full the driver waits (its progress bar says ``waiting for the
trainer``), so no new unit goes out: the replicas stop after the ``in_flight`` units already queued on
each. Live payloads in the object store: at most (``queue_units`` x ranks + replicas x 2 in flight + 1),
each about ``unit_tokens`` x the run's bytes per token; plus up to about one second of consumed ones,
which Ray's raylet frees in batches once a second (``free_objects_period_milliseconds``, 1000; measured:
592 MiB peak for 48 MiB live at 8 MiB units, 96 MiB at 100 ms). When the capture is slower, the trainer
blocks in the queue's ``get`` (``OnlineStream.wait_seconds`` counts it).

**Exactly once** (per run, from the checkpoint a trainer restarts from): see :mod:`shards.online`. A
restarted trainer calls :func:`start` again with the same ``cfg.out``: acked rows are skipped, the rest
captured again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time

from capture.config import RunConfig
from common.errors import CaptureError
from shards import live
from shards import manifest as manifest_mod
from shards.online import OnlineStream
from shards.run import resolve

log = logging.getLogger(__name__)
NAMESPACE = "capture-online"  # the Ray namespace of every online run's queue actors


@dataclasses.dataclass
class Online:
    """A running online capture: its queues (one per rank), its thread, its result once done."""

    cfg: RunConfig
    queues: list
    endpoint: dict  # what online-endpoint.json holds: {"address", "namespace", "queues", "world_size"}
    thread: threading.Thread | None = None
    summary: dict | None = None
    error: BaseException | None = None
    started_ray: bool = False  # start() started Ray: close() shuts it down
    delivered: set = dataclasses.field(default_factory=set)  # sample ids handed to a queue by this run
    trainer_wait_s: float = 0.0  # seconds the capture waited on a full queue (the trainer was the bottleneck)
    ended_at: float | None = None  # time.perf_counter() when the capture's driver returned

    def stream(self, rank: int = 0, **options) -> OnlineStream:
        """Rank ``rank``'s :class:`shards.online.OnlineStream` in this process (``options``: ``layers``,
        ``final``, ``topk``, ``poll_s``, ``timeout_s``); other processes use :func:`shards.online.attach`.
        Waits for the run header (the driver writes it once the model is prepared). Raises CaptureError for
        a rank outside ``[0, world_size)``."""
        if not 0 <= rank < len(self.queues):
            raise CaptureError(f"rank {rank} is not in [0, world_size={len(self.queues)})")
        return OnlineStream(self.endpoint, self.cfg.out, self._header(), rank, **options)

    def _header(self):
        while True:
            header = manifest_mod.read(self.cfg.out).header
            if header is not None:
                return header
            if self.thread is not None and not self.thread.is_alive():
                raise CaptureError(f"online capture ended before writing its header: {self.error}")
            time.sleep(0.2)

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the queues' actors, and Ray when :func:`start` started it. ``wait_s``: first wait up to that
        many seconds until every row this run delivered is acked (ranks in other processes still reading:
        their queue and the payloads it refers to live in this process); rows not acked by then are
        dropped with their payloads (logged) and delivered again by a restarted run. Without ``wait_s``
        rows still queued are dropped at once."""
        import ray

        start = time.monotonic()
        said = False
        while wait_s > 0:
            missing = self.delivered - live.acked_ids(resolve(self.cfg.out))
            if not missing or time.monotonic() - start >= wait_s:
                break
            if not said and time.monotonic() - start > 2:  # say what it waits for, once
                log.warning("online: waiting up to %g s for %d delivered row(s) to be acked (ranks reading "
                            "in other processes)", wait_s, len(missing))
                said = True
            time.sleep(0.5)
        if wait_s > 0 and missing:
            log.warning("online: closing with %d delivered row(s) not acked; a restarted run delivers them again",
                        len(missing))
        for q in self.queues:
            q.shutdown()
        if self.started_ray:
            ray.shutdown()

    def join(self) -> dict:
        """Wait for the capture; its summary dict (:class:`capture.summary.Summary`). Re-raises its error."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.summary


def start(cfg: RunConfig, world_size: int = 1, queue_units: int = 2, keep: bool = False) -> Online:
    """Start an online capture of ``cfg`` for ``world_size`` trainer ranks (module docstring). ``keep``:
    also commit every row to shards in ``cfg.out`` exactly as ``capture run`` does (same manifest,
    provenance, audit). Starts a local Ray instance unless one is connected (``cfg.ray_address`` to join
    a cluster). Returns at once; the driver runs on a daemon thread. Raises CaptureError for a world size
    or queue size below 1."""
    import uuid

    import ray
    from ray.util.queue import Full, Queue

    from capture.driver import run
    from capture.executor import on_driver_node
    from capture.sinks import Delivery

    if world_size < 1 or queue_units < 1:
        raise CaptureError("world_size and queue_units must be at least 1")
    acked = live.acked_ids(resolve(cfg.out)) if manifest_mod.read(cfg.out).header is not None else set()
    started = not ray.is_initialized()
    if started:
        ray.init(address=cfg.ray_address or "local", include_dashboard=False, logging_level=logging.ERROR)
    token = uuid.uuid4().hex[:12]
    names = [f"capture-online-{token}-rank{r}" for r in range(world_size)]
    queues = [Queue(maxsize=queue_units, actor_options={**on_driver_node(), "name": n, "namespace": NAMESPACE})
              for n in names]  # on the driver's node: a lost worker node does not take a rank's queue along
    endpoint = {"address": ray.get_runtime_context().gcs_address, "namespace": NAMESPACE, "queues": names,
                "world_size": world_size, "auth_mode": os.environ.get("RAY_AUTH_MODE")}
    online = Online(cfg, queues, endpoint, started_ray=started)
    delivered = online.delivered  # keep: a row redone after a replica died is not sent twice
    ranks = itertools.cycle(range(world_size))
    published = threading.Event()

    def publish() -> None:  # after the header: the driver refuses a folder that holds files but no run
        if not published.is_set():
            live.write_endpoint(resolve(cfg.out), endpoint)
            published.set()

    def deliver(info, payload, on_wait) -> None:
        skip = [sid for sid in info.sample_ids if sid in acked or sid in delivered]
        if len(skip) == len(info.sample_ids):
            return
        publish()
        delivered.update(info.sample_ids)
        rank = next(ranks)
        item = ("rows", {"info": dataclasses.asdict(info), "skip": skip}, payload)
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    queues[rank].put(item, block=True, timeout=0.5)
                    return
                except Full:
                    on_wait(f"waiting for the trainer: rank {rank}'s queue holds {queue_units} unit(s)")
        finally:
            online.trainer_wait_s += time.perf_counter() - t0

    def put_end(rank: int, queue, item) -> None:  # behind the rank's last units: says so while it waits
        while True:
            try:
                return queue.put(item, block=True, timeout=10)
            except Full:
                log.warning("online: the capture is done; rank %d's queue is still full (%d unit(s)): "
                            "is a trainer reading rank %d?", rank, queue_units, rank)

    def main() -> None:
        try:
            if keep:  # committed rows the trainer never acked come from the shards, before any new row
                for info, payload in _unacked(cfg.out, acked):
                    deliver(info, ray.put(payload), lambda status: None)
            online.summary = run(cfg, Delivery(deliver, keep)).as_dict()
            online.ended_at = time.perf_counter()
            publish()
            for rank, q in enumerate(queues):
                put_end(rank, q, ("end", online.summary, None))
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's streams and to join()
            online.error = e
            if manifest_mod.read(cfg.out).header is not None:  # ranks in other processes see the error too
                publish()
            for rank, q in enumerate(queues):
                put_end(rank, q, ("error", str(e) or type(e).__name__, None))

    online.thread = threading.Thread(target=main, name="online-capture", daemon=True)
    online.thread.start()
    return online


def _unacked(run_dir: str, acked: set[str]):
    """``(ShardInfo with path "", payload)`` per committed shard of ``run_dir`` that holds rows no trainer
    rank acked: those rows (stored order) as one payload, the cells copied as stored."""
    from shards.run import as_location
    from shards.writer import payload

    loc = as_location(run_dir)
    for shard in manifest_mod.read(loc).shards:
        rows = [i for i, sid in enumerate(shard["sample_ids"]) if sid not in acked]
        if rows:
            yield payload(loc.read_table(shard["path"], rows=shard["rows"]).take(rows))
