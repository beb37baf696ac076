"""Delivery sinks: where a replica's finished rows go, and what counts as committed.

A run has one sink, chosen by the driver (:func:`of`); the pool (:class:`capture.pool.ReplicaPool`) hands
it what replicas finish and the replica writes what the sink's :class:`Output` asks for; neither knows
which sink it is.

=================  ==========================  =====================================================
sink               replica writes              a row is committed when
=================  ==========================  =====================================================
:class:`Shards`    shards                      its shard's manifest line is written (offline)
:class:`Retain`    shards                      the same; before each commit, shards every reader
                                               acked are removed so at most ``--retain N`` stay
                                               (tail mode, :mod:`shards.retain`)
:class:`Online`    one payload per unit        it is handed to the trainer (no shards; online)
``Online(keep)``   shards and payloads (tee)   its shard's manifest line is written; the payload
                                               goes to the trainer once the unit's shards commit
=================  ==========================  =====================================================

A sink's interface (what the pool calls): ``output`` (:class:`Output`), ``commit(infos)`` for the
shards a replica closed, ``deliver(info, payload) -> bool`` for a unit's payload (True: the delivery
commits its rows). The driver also asks ``done(loc, manifest)`` (sample ids a resume skips),
``name`` (recorded in the completion record) and ``close(summary)`` (the sink's own summary fields).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import pyarrow as pa

from shards.run import Location
from shards.writer import ShardWriter, StreamWriter, TeeWriter


@dataclasses.dataclass(frozen=True)
class Output:
    """What a replica writes for each work unit (picklable: it travels to Ray actors). ``shards``: rows go
    to shard files the driver commits; ``payloads``: each unit's rows also come back as one Arrow IPC
    payload (:class:`shards.writer.StreamWriter`, the run codec's cells), returned beside the unit's result."""

    shards: bool = True
    payloads: bool = False

    def writer(self, out: Location | str, schema: pa.Schema, shard_size: int, threads: int):
        """The replica's writer: a ShardWriter, a StreamWriter, or both as a TeeWriter."""
        shards = ShardWriter(out, schema, shard_size, threads=threads) if self.shards else None
        payloads = StreamWriter(schema, threads=threads) if self.payloads else None
        return TeeWriter(shards, payloads) if shards and payloads else shards or payloads


class Shards:
    """Offline: every shard a replica closes is committed with one manifest line (``session.commit``)."""

    name = None
    output = Output()

    def __init__(self, session):
        self.session = session

    def commit(self, infos: Sequence) -> None:
        self.session.commit(infos)

    def deliver(self, info, payload) -> bool:
        raise RuntimeError("an offline run has no payloads")

    def done(self, loc: Location, manifest) -> set[str]:
        """Sample ids already in the run: the committed ones."""
        return manifest.sample_ids()

    def close(self, summary) -> None:
        pass


class Retain(Shards):
    """Tail mode (``--retain N``): before each commit, :class:`shards.retain.Retention` removes the shards
    every reader acked, waiting for acks while ``N`` committed shards are on disk."""

    def __init__(self, session, limit: int, progress):
        from shards.retain import Retention

        super().__init__(session)
        self.limit, self.progress = limit, progress
        self.retention = Retention(session.loc, session.writer, limit, on_wait=progress.tick)

    def commit(self, infos: Sequence) -> None:
        for info in infos:
            if self.retention.make_room():
                self.progress.status("capturing")
            self.session.commit([info])

    def close(self, summary) -> None:
        r = self.retention
        summary.retained = {"limit": self.limit, "removed_shards": r.removed_shards, "removed_rows": r.removed_rows,
                            "peak_live": r.peak_live, "wait_seconds": round(r.wait_seconds, 2)}


class Online(Shards):
    """Online (:mod:`capture.online`): each unit's payload goes to ``hand(info, payload, on_wait)`` (the
    trainer's queues; ``on_wait(status)`` while it blocks). Without ``keep`` no shard is written: the
    delivery is the commit, and rows the trainer acked (:func:`shards.live.acked_ids`) are done. With
    ``keep`` (tee) rows are committed to shards exactly as offline, and delivered once their shard is."""

    def __init__(self, session, hand: Callable, keep: bool, progress):
        super().__init__(session)
        self.hand, self.keep, self.progress = hand, keep, progress
        self.output = Output(shards=keep, payloads=True)
        self.name = "tee" if keep else "deliver"

    def deliver(self, info, payload) -> bool:
        self.hand(info, payload, self.progress.tick)
        self.progress.status("capturing")
        self.session.summary.delivered_units += 1
        if self.keep:
            return False
        self.session.count(info)  # no shards: what was delivered is what this run committed
        return True

    def done(self, loc: Location, manifest) -> set[str]:
        """Committed ids; without ``keep`` also every id a trainer acked (:mod:`shards.online`)."""
        from shards import live

        return manifest.sample_ids() | (set() if self.keep else live.acked_ids(loc))


@dataclasses.dataclass(frozen=True)
class Delivery:
    """What :func:`capture.driver.run` takes for an online run: ``hand(info, payload, on_wait)`` and ``keep``."""

    hand: Callable
    keep: bool = False


def of(cfg, session, progress, delivery: Delivery | None):
    """The run's sink: :class:`Online` for a delivery, :class:`Retain` for ``--retain``, else :class:`Shards`."""
    if delivery is not None:
        return Online(session, delivery.hand, delivery.keep, progress)
    if cfg.retain is not None:
        return Retain(session, cfg.retain, progress)
    return Shards(session)

