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
:func:`shards.stream.row_sample` (the sample dict of :mod:`shards.stream`: ``taps`` bf16 ``[T, L, H]``,
``final`` ``[T, H]``, ids, mask, argmax, top-K) and yields them in arrival order.

**Exactly once.** The trainer calls :meth:`OnlineStream.ack` with the sample ids it trained on, after the
checkpoint that covers them is saved. Each ack is one file ``online-consumed-<rank:05d>-<seq>-<ns>.json``
in the run folder (an atomic whole-file write, on a local folder or an object store). A restarted online
capture skips every acked id (:func:`consumed_ids`), and delivers again every row that was captured,
delivered or in flight but not acked: a row is trained on once per run, counted from the checkpoint the
trainer restarts from. A replica that dies mid-unit is replaced by the capture's pool and its unit
redone; a unit's payload reaches a queue only once its unit completed, so no row is delivered twice.

Iterate in the process that made the stream (DataLoader ``num_workers=0``): the queue and payload handles
belong to this process's Ray connection.
"""

from __future__ import annotations

import json
import os
import time
from typing import Iterator, Sequence

import pyarrow as pa
from torch.utils.data import IterableDataset

from capture.errors import CaptureError
from shards.format import RunHeader
from shards.run import Location, as_location
from shards.stream import row_sample

PREFIX = "online-consumed-"


def consumed_ids(run: str | os.PathLike | Location) -> set[str]:
    """Every sample id any rank acked in ``run`` (the files :meth:`OnlineStream.ack` wrote)."""
    loc = as_location(run)
    ids: set[str] = set()
    for name in loc.names():
        if name.startswith(PREFIX) and name.endswith(".json"):
            ids.update(json.loads(loc.read_bytes(name))["sample_ids"])
    return ids


def rows_of(payload) -> pa.Table:
    """The rows of one payload (a uint8 array holding an Arrow IPC stream), zero-copy over its buffer."""
    return pa.ipc.open_stream(pa.py_buffer(payload)).read_all()


class OnlineStream(IterableDataset):
    """Samples of an online run for one trainer rank (module docstring). Made by
    :meth:`capture.online.Online.stream`; ``layers``, ``final``, ``topk`` as in
    :class:`shards.stream.ShardStream`. ``wait_seconds``: time spent waiting for rows (the capture is the
    bottleneck while it grows); ``timeout_s``: raise CaptureError when no item arrives for that long."""

    def __init__(self, queue, run: str | os.PathLike | Location, header: RunHeader, rank: int = 0, *,
                 layers: Sequence[int] | None = None, final: bool = True, topk: bool = True,
                 poll_s: float = 0.5, timeout_s: float | None = None):
        self.queue, self.location, self.header, self.rank = queue, as_location(run), header, rank
        taps = list(header.tap_layers)
        wanted = taps if layers is None else [int(k) for k in layers]
        if [k for k in wanted if k not in taps] or not wanted:
            raise CaptureError(f"no tap(s) {[k for k in wanted if k not in taps] or wanted} in this run; it stores taps {taps}")
        self.taps_layers = tuple(wanted)
        self.final_kind = header.final_kind if final else None
        self.topk = header.topk if topk else 0
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.wait_seconds = 0.0
        self.summary: dict | None = None  # the capture's summary, once the end arrived
        self._acks = 0

    def __iter__(self) -> Iterator[dict]:
        import ray
        from ray.util.queue import Empty
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            raise CaptureError("iterate an OnlineStream in the process that started the run "
                               "(DataLoader num_workers=0): its queue belongs to that process's Ray connection")

        last = time.monotonic()
        while True:
            t0 = time.monotonic()
            try:
                kind, info, payload = self.queue.get(block=True, timeout=self.poll_s)
            except Empty:
                self.wait_seconds += time.monotonic() - t0
                if self.timeout_s is not None and time.monotonic() - last > self.timeout_s:
                    raise CaptureError(f"online: no rows from the capture for {self.timeout_s:g} s") from None
                continue
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
                yield row_sample(table, row, self.taps_layers, self.header.argmax, self.final_kind is not None,
                                 self.topk)

    def ack(self, sample_ids: Sequence[str]) -> None:
        """Record that this rank trained on ``sample_ids`` (call after the checkpoint that covers them is
        saved): a restarted capture never delivers them again. Raises OSError from the store."""
        body = {"rank": self.rank, "time": time.time(), "sample_ids": list(sample_ids)}
        name = f"{PREFIX}{self.rank:05d}-{self._acks:08d}-{time.time_ns():x}.json"
        self.location.write_bytes(name, json.dumps(body).encode())
        self._acks += 1
