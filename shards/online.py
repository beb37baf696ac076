"""The trainer's side of an online run (:mod:`capture.online`): rows that come from live capture replicas
through Ray, never from disk, and the consumed-ids log that makes a restarted trainer resume exactly once.

**Transport.** Each trainer rank has a bounded ``ray.util.queue.Queue``. Its items are
``("rows", {"info", "skip"}, payload)``: ``info`` the rows' :class:`shards.writer.ShardInfo` as a dict
(``path`` ""), ``skip`` the sample ids among them the trainer must not get again (a ``keep`` run redoes
rows whose shard a dead replica never closed),
``payload`` the handle (``ray.ObjectRef``) of a uint8 array holding one Arrow IPC stream with the run's
shard schema and cells (:class:`shards.writer.StreamWriter`), owned by the capture's driver, not by the
replica that made it; ``("end", summary)`` after the last rows; ``("error", message)`` when the capture
failed. :class:`OnlineStream` fetches a payload (zero-copy from the object store), decodes its rows with
:func:`shards.rows.table_sample` in the layout of the payload's header (the sample dict of
:mod:`shards.stream`: ``taps`` bf16 ``[T, L, H]``, ``final`` ``[T, H]``, ids, mask, argmax, top-K) and
yields them in arrival order.

**Exactly once.** The trainer calls :meth:`OnlineStream.ack` with the sample ids it trained on, after the
checkpoint that covers them is saved. Each ack is one file in the run folder (:mod:`shards.live`,
``kind="online"``: an atomic whole-file write, on a local folder or an object store). A restarted online
capture skips every acked id (:func:`shards.live.acked_ids`), and delivers again every row that was captured,
delivered or in flight but not acked: a row is trained on once per run, counted from the checkpoint the
trainer restarts from. A replica that dies mid-unit is replaced by the capture's pool and its unit
redone; a unit's payload reaches a queue only once its unit completed, so no row is delivered twice.

**Ranks and workers in other processes.** :func:`capture.online.start` names each rank's queue actor and
writes where to find them, the endpoint (:mod:`shards.live`: the Ray cluster's GCS address, a namespace, one
queue name per rank), into the run folder. :func:`attach` reads it in any process that can reach that cluster (a
``torchrun`` rank, on this node or another) and returns that rank's stream. A stream holds names, not
handles: it connects when iterated, so it pickles into DataLoader workers, which then take units from their
rank's queue in turn (each unit to one worker; order across workers is arrival order, interleaved). A
worker is a Ray driver of its own: spawn it (``multiprocessing_context="spawn"``) when its parent process
is connected to Ray (a forked copy of a Ray connection does not work; refused in one line). The ``end``
item is put back by whichever consumer takes it, so every worker of the rank stops. Acks are by sample id
and may come from any process (the trainer's main process, after its checkpoint).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Iterator, Sequence

import pyarrow as pa
from torch.utils.data import IterableDataset

from common.errors import CaptureError
from common.net import gcs_unreachable
from shards import live
from shards.format import RunHeader, tap_layers
from shards.rows import table_sample
from shards.run import Location, as_location

log = logging.getLogger(__name__)


def rows_of(payload) -> pa.Table:
    """The rows of one payload (a uint8 array holding an Arrow IPC stream), zero-copy over its buffer."""
    return pa.ipc.open_stream(pa.py_buffer(payload)).read_all()


def attach(run: str | os.PathLike | Location, rank: int = 0, wait_s: float = 600.0, **options) -> "OnlineStream":
    """Rank ``rank``'s stream of the online run capturing into ``run``, from any process (module docstring):
    waits up to ``wait_s`` seconds for the run's endpoint, its header and live queues (a capture that is
    still loading its model, or an endpoint left by an earlier run of that folder). ``options``: as
    :class:`OnlineStream`. Raises CaptureError after ``wait_s``, or for a rank outside the run's world size."""
    from shards import manifest as manifest_mod

    loc = as_location(run)
    start = time.monotonic()
    said = False
    why = f"no {live.ENDPOINT} in {loc}: start the capture (capture.online.start) first"
    while True:
        endpoint = live.read_endpoint(loc)
        if endpoint is not None:
            if not 0 <= rank < endpoint["world_size"]:
                raise CaptureError(f"rank {rank} is not in [0, world_size={endpoint['world_size']})")
            header = manifest_mod.read(loc).header
            stream = OnlineStream(endpoint, loc, header, rank, **options) if header is not None else None
            if stream is not None and stream.live():
                return stream
            why = (f"the online run in {loc} has not written its header yet" if header is None else
                   f"the Ray cluster or queues named in {loc}/{live.ENDPOINT} are gone (an earlier run's endpoint: "
                   "the new run rewrites it with its first unit)")
        if time.monotonic() - start > wait_s:
            raise CaptureError(f"online: {why} (waited {wait_s:g} s)")
        if not said and time.monotonic() - start > 5:
            log.warning("online: waiting up to %g s for rank %d's stream: %s", wait_s, rank, why)
            said = True
        time.sleep(0.5)


def _token_auth() -> None:
    """Turn on Ray's token authentication in this process, as ``ray.init(address="auto")`` does for a local
    cluster it finds (Ray 2.60 ``worker.py``): a new local cluster enables token auth (the token in
    ``~/.ray/auth_token``, or ``RAY_AUTH_TOKEN``) in its own process only, and an explicit address never
    turns it on. No-op when ``RAY_AUTH_MODE`` is set or no token is found."""
    from ray._private.authentication import authentication_token_setup as setup

    quiet = logging.getLogger(setup.__name__)  # its "token authentication is enabled" warning, once a process
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        quiet.setLevel(level)


def _queue(name: str, namespace: str):
    """The ``ray.util.queue.Queue`` whose actor is named ``name`` (the queue class has no attach-by-name
    constructor: a shell around the named actor's handle). Raises ValueError when no such actor lives."""
    import ray
    from ray.util.queue import Queue

    queue = Queue.__new__(Queue)
    queue.maxsize, queue.actor = 0, ray.get_actor(name, namespace=namespace)
    return queue


class OnlineStream(IterableDataset):
    """Samples of an online run for one trainer rank (module docstring). Made by :func:`attach` or
    :meth:`capture.online.Online.stream`: ``endpoint`` is the run's ``online-endpoint.json``; ``layers``,
    ``final``, ``topk`` as in :class:`shards.stream.ShardStream`. ``wait_seconds``: time this copy spent
    waiting for rows (the capture is the bottleneck while it grows; a DataLoader worker's copy keeps its
    own); ``timeout_s``: raise CaptureError when no item arrives for that long."""

    def __init__(self, endpoint: dict, run: str | os.PathLike | Location, header: RunHeader, rank: int = 0, *,
                 layers: Sequence[int] | None = None, final: bool = True, topk: bool = True,
                 poll_s: float = 0.5, timeout_s: float | None = None):
        self.endpoint, self.location, self.header, self.rank = endpoint, as_location(run), header, rank
        self.columns = header.layout.columns_for(layers, final)  # the state columns decoded
        self.taps_layers = tap_layers(self.columns)
        self.final_kind = header.final_kind if final else None
        self.topk = header.topk if topk else 0
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.wait_seconds = 0.0
        self.summary: dict | None = None  # the capture's summary, once the end arrived
        self._queue = None  # (pid, this process's handle on the rank's queue): made when iterated, never pickled

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_queue": None}

    def queue(self):
        """This rank's queue, connecting this process to the run's Ray cluster first if it is not (a trainer
        rank of its own, a spawned DataLoader worker). Raises CaptureError in a DataLoader worker forked
        from a process connected to Ray (a forked copy of a Ray connection does not work)."""
        import logging

        import ray
        from torch.utils.data import get_worker_info

        if self._queue is None or self._queue[0] != os.getpid():  # none yet, or a forked copy's
            if not ray.is_initialized():
                if self.endpoint.get("auth_mode") == "token":
                    _token_auth()
                ray.init(address=self.endpoint["address"], namespace=self.endpoint["namespace"],
                         logging_level=logging.ERROR, log_to_driver=False)
            elif get_worker_info() is not None:
                raise CaptureError("a DataLoader worker forked from a process connected to Ray cannot use that "
                                   "connection: pass multiprocessing_context='spawn' to the DataLoader")
            self._queue = os.getpid(), _queue(self.endpoint["queues"][self.rank], self.endpoint["namespace"])
        return self._queue[1]

    def live(self) -> bool:
        """Whether this rank's queue actor is alive (False for an endpoint an earlier run left). Probes the
        cluster's address first: ``ray.init`` to a cluster that is gone retries for minutes."""
        import ray

        if not ray.is_initialized() and gcs_unreachable(self.endpoint["address"]):
            return False
        try:
            self.queue()
            return True
        except (ValueError, ConnectionError):  # no such actor; no such cluster (Ray gives up after its retries)
            return False

    def __iter__(self) -> Iterator[dict]:
        import ray
        from ray.util.queue import Empty

        queue = self.queue()
        last = time.monotonic()
        while True:
            t0 = time.monotonic()
            try:
                item = queue.get(block=True, timeout=self.poll_s)
                kind, info, payload = item
            except Empty:
                self.wait_seconds += time.monotonic() - t0
                if self.timeout_s is not None and time.monotonic() - last > self.timeout_s:
                    raise CaptureError(f"online: no rows from the capture for {self.timeout_s:g} s") from None
                continue
            if kind in ("end", "error"):
                try:
                    queue.put(item)  # for the rank's other consumers (DataLoader workers): each must see it
                except ray.exceptions.RayActorError:
                    pass  # the run was closed: no consumer is left waiting on its queue
            if kind == "end":
                self.summary = info
                return
            if kind == "error":
                raise CaptureError(f"online capture failed: {info}")
            table = rows_of(ray.get(payload))
            self.wait_seconds += time.monotonic() - t0
            last = time.monotonic()
            skip = set(info["skip"])  # rows this trainer already has (acked, or sent before a replica died)
            for row, sid in enumerate(table.column("sample_id").to_pylist()):
                if sid in skip:
                    continue
                yield table_sample(table, row, self.columns, self.topk)

    def ack(self, sample_ids: Sequence[str]) -> None:
        """Record that this rank trained on ``sample_ids`` (call after the checkpoint that covers them is
        saved): a restarted capture never delivers them again. Raises OSError from the store."""
        live.write(self.location, live.Ack("online", self.rank, int(self.endpoint["world_size"]), time.time(),
                                           sample_ids=tuple(sample_ids)))
