"""What a capture shows while it runs, and where its time went.

One tqdm bar for the whole run, in tokens through the engine. Its description names the phase
(``preparing``: model conversion, tokenizer, dataset; ``starting Ray``; ``loading the engine on N
replica(s), k ready``; ``capturing``), and the driver refreshes it at least every :data:`REFRESH_S`
seconds while it waits (:data:`LOG_S` into a log file), so the elapsed time moves during a model load and before the first unit ends.
Tokens arrive per forward batch, not per work unit: each replica puts the batch's token count on a
feed (:func:`feed`, a ``ray.util.queue.Queue``: a small actor that reserves no CPU; :class:`LocalFeed` for a
replica in the driver's process) and the driver drains it on every refresh. The postfix counts rows through the engine, rows committed, MiB committed and an ETA.
The bar first draws :data:`DELAY_S` seconds into the run (tqdm's ``delay``), so a user error found
while preparing prints as its one line alone.

:class:`Timings` adds up the wall-clock seconds of each part of a run for the summary: ``prepare``
(driver: model conversion, tokenizer, dataset), ``start`` (Ray and the replicas' engine loads, wall
clock), ``engine`` (forward and generation calls, summed over replicas), ``write`` (encoding and writing
shards in each replica's writer thread, beside the engine; summed over replicas) and ``commit``
(driver: manifest lines).
"""

from __future__ import annotations

import dataclasses
import queue
import sys
from typing import IO

REFRESH_S = 0.5  # the longest the display goes without a redraw while a run waits
LOG_S = 10.0  # the same where stderr is no terminal (a log file, `ray job submit`)
DELAY_S = 2.0  # nothing is drawn before this many seconds (the checks that refuse a run come first)


@dataclasses.dataclass
class Timings:
    """Seconds per part of a run (module docstring); ``engine`` and ``write`` are summed over replicas."""

    prepare: float = 0.0
    start: float = 0.0
    engine: float = 0.0
    write: float = 0.0
    commit: float = 0.0

    def as_dict(self) -> dict:
        return {k: round(v, 2) for k, v in dataclasses.asdict(self).items()}


def feed(actor_options: dict):
    """A replica → driver channel for token counts (``ray.util.queue.Queue``; needs Ray initialized), its
    actor made with ``actor_options`` (the executor's: no CPU, so it never competes with the replicas for a
    slot, on the driver's node, :func:`capture.executor.on_driver_node`)."""
    from ray.util.queue import Queue

    return Queue(actor_options=actor_options)


class LocalFeed(queue.SimpleQueue):
    """The feed of a replica in the driver's own process: the calls of Ray's queue that the replica and
    :class:`Progress` use, without an actor."""

    def get_nowait_batch(self, n: int) -> list:
        return [self.get_nowait() for _ in range(n)]

    def shutdown(self) -> None:
        pass


class Progress:
    """The run's bar (module docstring). ``enabled``: draw it (else every call is a cheap no-op but the
    feed is still drained); ``file``: where to draw (default stderr); ``interval``: the least seconds
    between redraws (default :data:`REFRESH_S` on a terminal, :data:`LOG_S` otherwise: a log file gets a
    line every 10 s, not a redraw every half second). Call :meth:`tick` while waiting and :meth:`close`
    at the end."""

    def __init__(self, enabled: bool, *, file: IO | None = None, interval: float | None = None):
        from tqdm import tqdm

        if interval is None:
            interval = REFRESH_S if (file or sys.stderr).isatty() else LOG_S
        # miniters=0: update(0) redraws whenever `interval` has passed (tqdm's own rate limit and delay)
        self.bar = tqdm(desc="capture [starting]", unit="tok", unit_scale=True, disable=not enabled,
                        dynamic_ncols=True, file=file, mininterval=interval, miniters=0, delay=DELAY_S)
        self.feed = None  # a Feed once Ray runs (see :func:`feed`)
        self.tokens = 0
        self._status = "starting"

    @property
    def description(self) -> str:
        return f"capture [{self._status}]"

    def status(self, text: str) -> None:
        """Name the phase the run is in (shown at the next redraw)."""
        if text != self._status:
            self._status = text
            self.bar.set_description_str(self.description, refresh=False)
        self.bar.update(0)

    def tick(self, status: str | None = None) -> None:
        """Drain the feed (tokens per forward batch), set the phase when given, redraw."""
        if self.feed is not None:
            n = self.feed.qsize()
            if n:
                got = sum(self.feed.get_nowait_batch(n))
                self.tokens += got
                self.bar.update(got)
        if status is not None:
            self.status(status)
        else:
            self.bar.update(0)

    def postfix(self, **values) -> None:
        self.bar.set_postfix(**values, refresh=False)

    def close(self) -> None:
        """Count what is still on the feed, close the bar, shut the feed's actor down (idempotent)."""
        if self.feed is not None:
            self.tick()
            self.feed.shutdown()
            self.feed = None
        self.bar.close()
