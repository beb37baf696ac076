"""Tail mode with bounded disk: readers acknowledge the shards they consumed, a capture run with
``--retain N`` deletes the shards every reader rank has consumed and holds at most N committed shards.

**Acks.** A tail-mode :class:`shards.stream.ShardStream` rank acks in the run folder
(:meth:`shards.stream.ShardStream.ack`; the file and its format: :mod:`shards.live`, ``kind="tail"``): its
``shards`` are the committed shards (not yet removed) none of whose rows this rank still has to read at
``position``; a rank's latest ack counts. A trainer acks *after* it saved
the checkpoint that holds the same stream state: a restart from that checkpoint never needs a row of a
shard it acked, so removal keeps exactly-once (a restart from an older checkpoint would need them).

**Removal.** :func:`removable` is the set of live shards that every rank ``0..W-1`` lists as done, where
``W`` is the world size all acks agree on (a missing rank, or acks of two world sizes, remove nothing).
:class:`Retention` runs in the capture's driver before each shard commit: while the live committed
shards would exceed ``N``, it removes what the acks allow (a ``removed`` manifest line first, then the
files) and otherwise waits, polling, and says so on the progress bar (the trainer is the bottleneck).
Meanwhile no new work unit goes out, so the replicas stop after the units already queued: on disk are at
most N committed shards plus, per replica, the shards of the units it holds (a shard commits with the unit
that closes it: up to ``in_flight`` = 2 units of ``--unit-tokens`` each, 32,768 tokens by default, ~1.6 GB a
unit for GLM-5.3 at bf16-split). To bound the disk tightly, lower ``--unit-tokens`` with ``--retain``.

One reader group per run: every rank reads the same ``split`` with the same settings. A shard a train
stream consumed is removed with its held-out rows (``split="heldout"`` readers must read another run, or
a run without ``--retain``), and a retained run is read once (one epoch): a second epoch would need the
removed shards.

Deadlock rule: a rank acks only at checkpoints, so N shards must hold more rows than one rank consumes
between two checkpoints times the world size, plus the shuffle buffer and the DataLoader's prefetch;
otherwise the capture waits for an ack that needs rows it has not committed. The capture's progress says
``waiting for readers`` and each rank's last ack, which shows this.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from common.errors import CaptureError
from shards import live
from shards import manifest as manifest_mod
from shards.run import Location

log = logging.getLogger(__name__)

def removable(manifest: manifest_mod.Manifest, acks: dict[int, live.Ack]) -> list[str]:
    """Live shards of ``manifest`` that every rank lists as done (``acks``: each rank's latest tail ack,
    :func:`shards.live.latest`), in commit order (module docstring)."""
    sizes = {a.world_size for a in acks.values()}
    if len(sizes) != 1:
        return []
    (world,) = sizes
    if set(acks) != set(range(world)):
        return []
    done = set.intersection(*(set(a.shards) for a in acks.values()))
    return [s["path"] for s in manifest.shards if s["path"] in done]


def waiting_for(acks: dict[int, live.Ack]) -> str:
    """One line for the progress bar: what the capture waits for."""
    if not acks:
        return "no reader has acked yet"
    worlds = sorted({a.world_size for a in acks.values()})
    missing = [r for r in range(max(worlds)) if r not in acks]
    if len(worlds) > 1:
        return f"acks of world sizes {worlds}: remove the stale {live.PREFIX}*{live.SUFFIX} files"
    if missing:
        return f"no ack yet from rank(s) {missing[:4]}"
    return "ranks at positions " + ", ".join(str(acks[r].position) for r in sorted(acks)[:4])


class Retention:
    """The driver's side (module docstring): call :meth:`make_room` before each commit. ``limit``: N;
    ``on_wait(status)`` is called at every poll while it waits (the progress bar); ``poll_s``: seconds
    between reads of the acks. ``removed_shards``/``removed_rows`` count what this run removed."""

    def __init__(self, loc: Location, writer: manifest_mod.ManifestWriter, limit: int, *,
                 on_wait: Callable[[str], None], poll_s: float = 0.5):
        if limit < 1:
            raise CaptureError(f"--retain must be at least 1, got {limit}")
        self.loc, self.writer, self.limit, self.on_wait, self.poll_s = loc, writer, limit, on_wait, poll_s
        self.removed_shards = self.removed_rows = self.peak_live = 0
        self.wait_seconds = 0.0

    def make_room(self) -> bool:
        """Return once fewer than ``limit`` committed shards are on disk (so one more may commit), removing
        consumed ones; waits (polling every ``poll_s``, no busy loop) while the readers have not consumed
        enough. Returns whether it waited."""
        waited = False
        while True:
            manifest = manifest_mod.read(self.loc)
            kept = len(manifest.shards)
            if kept < self.limit:
                self.peak_live = max(self.peak_live, kept + 1)
                return waited
            acks = live.latest(self.loc)
            paths = removable(manifest, acks)
            if paths:
                self._remove(manifest, paths, len(acks))
                continue
            self.on_wait(f"waiting for readers: {kept} committed shard(s) kept, --retain {self.limit}; "
                         f"{waiting_for(acks)}")
            t0 = time.monotonic()
            time.sleep(self.poll_s)
            self.wait_seconds += time.monotonic() - t0
            waited = True

    def _remove(self, manifest: manifest_mod.Manifest, paths: list[str], ranks: int) -> None:
        gone = set(paths)
        rows = sum(s["rows"] for s in manifest.shards if s["path"] in gone)
        self.writer.removed(paths, f"consumed by all {ranks} reader rank(s) (--retain {self.limit})")
        for path in paths:
            self.loc.delete(path)
        self.removed_shards += len(paths)
        self.removed_rows += rows
        log.info("removed %d consumed shard(s), %d row(s)", len(paths), rows)
