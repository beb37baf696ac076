"""Engine replicas (Ray actors, or one in this process): work units handed out with backpressure, retried
when a replica fails.

The driver (:mod:`capture.driver`) streams work units into :meth:`ReplicaPool.submit`; the pool keeps
``in_flight`` units queued on each replica (an actor runs its calls in order, so the next unit is already
there when one ends and no replica idles) and blocks the driver while every replica is full
(backpressure: the driver never holds more than ``replicas × in_flight`` units). Every closed shard a
replica reports goes to the run's sink (:mod:`capture.sinks`; offline: the manifest line, the only commit).

Exactly-once: a replica's rows reach a shard only through its writer, and a shard counts only once the
driver commits it. The pool remembers, per replica, every record it handed out that no committed shard
holds yet (in flight, or written into the replica's open shard). When a replica fails — its process dies
(``RayActorError``), a unit raises, or a unit runs past ``unit_timeout`` seconds — the pool kills the
actor (its open shard is never committed: an uncommitted file, removed at the end of the run), starts a
replacement, and hands those records out again. The unit that was running counts one attempt (the
earliest unit queued on the replica: Ray runs an actor's calls in submission order); the others were not
at fault. A unit that failed ``max_attempts`` times is split in halves and retried; a single record that
failed ``max_attempts`` times is quarantined with its reason (not written; the run goes on; a rerun
tries it again). Fatal errors are raised, not retried: CaptureError, and OSError ENOSPC (a full disk).

A lost node (Ray marks it dead: a preempted machine, its raylet and every worker gone) fails its replicas
as above; their replacements go where the live nodes have room (:meth:`RayCalls.fits`), and a slot whose
replacement cannot be placed is dropped with a warning, the run going on with fewer replicas (the summary's
``lost_nodes``, ``units_redone``, ``dropped``). The run's own helper actors live on the driver's node
(:func:`capture.executor.on_driver_node`), so a lost worker node never takes one along.

The pool reaches its replicas through a small calls interface: :class:`RayCalls` (Ray actors, each its
own process; the default) or :class:`LocalCalls` (one replica in the driver's process, on a worker
thread: no Ray daemons, no second copy of the process; what ``capture run`` uses for one HF replica on
one machine). In-process, a unit that raises is handled as
above (the replica is dropped and a fresh one takes its records), but a hung unit cannot be killed (no
``unit_timeout``) and a crash of the engine ends the run, which a rerun resumes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import time
from typing import Callable, Sequence

from common.errors import CaptureError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Unit:
    records: list  # capture.chat.Tokenized | capture.chat.Prompt
    attempts: int = 0
    last_error: str = ""

    @property
    def tokens(self) -> int:
        return sum(r.num_tokens for r in self.records)


@dataclasses.dataclass
class ReplicaStats:
    """Per replica slot, over its actors: ``restarts`` counts replacements after a failure."""

    replica: int
    units: int = 0
    rows: int = 0
    tokens: int = 0
    busy_seconds: float = 0.0
    engine_seconds: float = 0.0
    write_seconds: float = 0.0
    restarts: int = 0
    failures: dict = dataclasses.field(default_factory=dict)  # reason → count
    units_redone: int = 0  # units handed out again after this slot's replicas failed
    lost_nodes: list = dataclasses.field(default_factory=list)  # Ray nodes lost under this slot (their addresses)
    dropped: str = ""  # why the slot has no replica any more (its node was lost and no other has room)


class ReplicaFailed(Exception):
    """A replica call failed. ``cause``: the exception the replica raised (None: its process died);
    ``original``: what to re-raise for an error that is not retried (Ray's error carries the remote
    traceback); ``reason``: one line for the summary."""

    def __init__(self, reason: str, cause: BaseException | None, original: BaseException):
        super().__init__(reason)
        self.reason, self.cause, self.original = reason, cause, original


class RayCalls:
    """Replica calls through Ray actor handles (``make_actor`` returns ``ray.remote(...)(cls).remote(...)``);
    ``cpus``/``gpus``: what one replica reserves (for :meth:`fits`)."""

    def __init__(self, cpus: int = 1, gpus: float = 0):
        import ray

        self._ray = ray
        self.need = {"CPU": cpus, "GPU": gpus}
        self._dead = self._dead_nodes()

    def _dead_nodes(self) -> set[str]:
        return {f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in self._ray.nodes() if not n["Alive"]}

    def lost_nodes(self) -> list[str]:
        """Nodes (address and id) Ray has marked dead since the previous call, sorted."""
        dead = self._dead_nodes()
        lost, self._dead = sorted(dead - self._dead), dead
        return lost

    def fits(self, replicas: int) -> bool:
        """Whether ``replicas`` replicas fit the resources of the cluster's live nodes."""
        total = self._ray.cluster_resources()
        return all(total.get(k, 0) >= replicas * v for k, v in self.need.items() if v)

    def call(self, actor, method: str, *args, returns: int = 1):
        """One call; ``returns`` > 1: a list of that many handles (Ray ``num_returns``), each object owned
        by this process (it outlives the actor)."""
        return getattr(actor, method).options(num_returns=returns).remote(*args)

    def wait(self, handles: list, timeout: float | None) -> list:
        return self._ray.wait(handles, num_returns=1, timeout=timeout)[0]

    def get(self, handle):
        """The call's result; raises ReplicaFailed."""
        ray = self._ray
        try:
            return ray.get(handle)
        except ray.exceptions.RayTaskError as e:
            raise ReplicaFailed(_reason(e.cause) if e.cause is not None else type(e).__name__, e.cause, e) from None
        except ray.exceptions.RayActorError as e:
            raise ReplicaFailed("replica process died", None, e) from None

    def kill(self, actor) -> None:
        self._ray.kill(actor, no_restart=True)

    def release(self, actor) -> None:
        """The run is over: nothing to do; Ray ends an actor once the driver drops its handles, letting it
        exit cleanly (a ``ray.kill`` would skip an engine's own shutdown, e.g. vLLM's TP workers)."""


@dataclasses.dataclass
class LocalActor:
    """A replica object in this process and the one thread its calls run on, in submission order."""

    replica: object
    thread: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="replica"))


class LocalCalls:
    """Replica calls in the driver's process (``make_actor`` returns a :class:`LocalActor`). ``kill``
    drops the replica: its open shard is never committed (removed at the end of the run, as for a killed
    Ray actor); a call already running cannot be stopped, so the pool refuses a ``unit_timeout``."""

    def call(self, actor: LocalActor, method: str, *args, returns: int = 1) -> concurrent.futures.Future:
        if returns != 1:
            raise CaptureError("payload returns need replicas on Ray (--executor ray)")
        return actor.thread.submit(getattr(actor.replica, method), *args)

    def wait(self, handles: list, timeout: float | None) -> list:
        done, _ = concurrent.futures.wait(handles, timeout, concurrent.futures.FIRST_COMPLETED)
        return [h for h in handles if h in done]

    def get(self, handle: concurrent.futures.Future):
        """The call's result; raises ReplicaFailed."""
        try:
            return handle.result()
        except Exception as e:  # noqa: BLE001 - handed to the pool, which retries or re-raises it
            raise ReplicaFailed(_reason(e), e, e) from None

    def kill(self, actor: LocalActor) -> None:
        actor.thread.shutdown(wait=False, cancel_futures=True)
        actor.replica = None

    def lost_nodes(self) -> list[str]:
        return []  # one process: no node to lose without losing the driver

    def fits(self, replicas: int) -> bool:
        return True

    def release(self, actor: LocalActor) -> None:
        """The run is over: calls not started are cancelled, a running one is waited for, then the replica's
        threads end and its engine is dropped."""
        actor.thread.shutdown(wait=True, cancel_futures=True)
        if actor.replica is not None:
            actor.replica.close()
            actor.replica = None


@dataclasses.dataclass
class _Slot:
    actor: object
    queue: list  # [(ObjectRef, Unit)] in submission order
    uncommitted: dict  # sample_id → record: handed to this actor, in no committed shard yet
    started: float = 0.0  # when the head of `queue` began (its predecessor ended or it was submitted)


class ReplicaPool:
    """``make_actor()`` returns a started-or-starting replica actor handle (``start``, ``process``,
    ``finish``); ``on_result(result)`` sees every
    :class:`capture.replica.UnitResult` (progress, counts). ``unit_timeout``: seconds one unit may run
    (None: no limit). ``on_tick(status)`` is called at least every ``tick_s`` seconds while the pool waits
    (for a live display): ``status`` names what it waits for (engine loads) or is None (units running).
    ``start_seconds``: wall-clock seconds spent waiting for replicas to load their engines. ``sink``
    (:mod:`capture.sinks`) gets what replicas finish: ``sink.commit(infos)`` every closed shard, and, when
    its ``output.payloads`` asks replicas for them (units go to ``Replica.process_with_payload``),
    ``sink.deliver(info, payload)`` each unit's payload (a Ray object this process owns) after the unit's
    shards are committed; a ``deliver`` that returns True has committed the unit's rows (otherwise rows
    count once their shard is: a replica that dies with an open shard has those rows redone)."""

    def __init__(self, make_actor: Callable[[], object], replicas: int, *, sink,
                 on_result: Callable[[object], None], in_flight: int = 2, unit_timeout: float | None = None,
                 max_attempts: int = 3, on_tick: Callable[[str | None], None] = lambda status: None,
                 tick_s: float = 0.5, calls: RayCalls | LocalCalls | None = None):
        self.calls = calls or RayCalls()
        self.sink = sink
        self._payloads: dict = {}  # payload sinks: a unit's result handle → its payload handle
        if unit_timeout is not None and isinstance(self.calls, LocalCalls):
            raise CaptureError("--unit-timeout needs replicas in processes of their own (--executor ray): "
                               "an in-process unit cannot be stopped")
        self.make_actor, self.on_result = make_actor, on_result
        self.in_flight, self.unit_timeout, self.max_attempts = in_flight, unit_timeout, max_attempts
        self.on_tick, self.tick_s = on_tick, tick_s
        self.slots = [_Slot(make_actor(), [], {}) for _ in range(replicas)]
        self.stats = [ReplicaStats(i) for i in range(replicas)]
        self.retry: list[Unit] = []
        self.quarantined: dict[str, str] = {}  # sample_id → reason
        self.start_seconds = 0.0
        self._start(list(range(replicas)))

    def _start(self, slots: list[int]) -> None:
        """Wait for the replicas of ``slots`` to load their engines, ticking meanwhile. A node Ray marks dead
        meanwhile (its replica died: the replacement is waiting for room) drops waiting slots, newest first,
        until the live nodes can hold the rest (:meth:`_drop`)."""
        t0 = time.monotonic()
        pending = {self.calls.call(self.slots[i].actor, "start"): i for i in slots}
        deaths: dict[int, int] = {}  # slot → replicas of it that died while starting
        n = len(pending)
        try:
            while pending:
                self.on_tick(f"loading the engine on {n} replica(s), {n - len(pending)} ready")
                for ref in self.calls.wait(list(pending), self.tick_s):
                    i = pending.pop(ref)
                    try:
                        self.calls.get(ref)
                    except ReplicaFailed as e:  # its process died while starting (a node lost, OOM): again
                        deaths[i] = deaths.get(i, 0) + 1
                        self.stats[i].lost_nodes += self.calls.lost_nodes()
                        if e.cause is not None or deaths[i] > self.max_attempts:
                            raise
                        self.calls.kill(self.slots[i].actor)
                        self.slots[i].actor = self.make_actor()
                        pending[self.calls.call(self.slots[i].actor, "start")] = i
                lost = self.calls.lost_nodes()
                for ref, i in sorted(pending.items(), key=lambda item: -item[1]):
                    if lost or self.stats[i].lost_nodes:
                        self.stats[i].lost_nodes += [x for x in lost if x not in self.stats[i].lost_nodes]
                        if not self.calls.fits(sum(1 for s in self.slots if s.actor is not None)):
                            pending.pop(ref)
                            self._drop(i)
        except ReplicaFailed as e:
            if isinstance(e.cause, CaptureError):  # e.g. an engine argument vLLM refuses: one line, exit 2
                raise e.cause from None
            raise e.original from None
        finally:
            self.start_seconds += time.monotonic() - t0
        self.on_tick("capturing")

    def _drop(self, i: int) -> None:
        """Give up slot ``i`` (its node was lost and no live node has room for its replica); its records were
        handed out again already. Raises CaptureError when no replica is left."""
        slot, stats = self.slots[i], self.stats[i]
        self.calls.kill(slot.actor)
        slot.actor = None
        nodes = ", ".join(stats.lost_nodes) or "unknown"
        stats.dropped = f"node lost ({nodes}); no live node had room for a replacement"
        others = sum(1 for s in self.slots if s.actor is not None)
        log.warning("replica %d: its node was lost (%s) and no live node has room to replace it: going on with %d "
                    "replica(s)", i, nodes, others)
        if not others:
            raise CaptureError(f"every replica is lost (last: replica {i}, node {nodes}); what was committed stays: "
                               "rerun the same command once the cluster has room to resume")

    def submit(self, records: list) -> None:
        """Queue one unit on the least-loaded replica; waits (handling results and failures) while all
        are full, and hands out retried units first."""
        while True:
            while self.retry and self._free_slot() is not None:
                self._send(self._free_slot(), self.retry.pop(0))
            slot = self._free_slot()
            if slot is not None:
                self._send(slot, Unit(records))
                return
            self._wait()

    def drain(self) -> None:
        """Wait until every unit (and every retry) has been processed."""
        while self.retry or any(s.queue for s in self.slots):
            while self.retry and self._free_slot() is not None:
                self._send(self._free_slot(), self.retry.pop(0))
            if any(s.queue for s in self.slots):
                self._wait()

    def finish(self) -> None:
        """Drain, then close every replica's open shard and commit it; a replica failing here has its
        uncommitted records retried on a replacement."""
        while True:
            self.drain()
            failed = False
            for i, slot in enumerate(self.slots):
                if slot.actor is None:  # dropped with its lost node
                    continue
                try:
                    infos = self.calls.get(self.calls.call(slot.actor, "finish"))
                except ReplicaFailed as e:
                    if _fatal(e.cause):
                        raise e.cause from None
                    self._fail(i, e.reason, charge=False)
                    failed = True
                    continue
                self._committed(slot, infos)
            if not failed:
                return

    def close(self) -> None:
        """Release every replica (the run's end, after :meth:`finish` or a failure): in-process replicas
        free their engines; Ray actors end once the driver drops their handles."""
        for slot in self.slots:
            if slot.actor is None:
                continue
            try:
                self.calls.release(slot.actor)
            except Exception as e:  # noqa: BLE001 - a replica that is already gone has nothing to release
                log.debug("releasing a replica: %s", e)

    def _free_slot(self) -> int | None:
        loads = [(len(s.queue), i) for i, s in enumerate(self.slots)
                 if s.actor is not None and len(s.queue) < self.in_flight]
        return min(loads)[1] if loads else None

    def _send(self, i: int, unit: Unit) -> None:
        slot = self.slots[i]
        if not slot.queue:
            slot.started = time.monotonic()
        if self.sink.output.payloads:
            ref, payload = self.calls.call(slot.actor, "process_with_payload", unit.records, returns=2)
            self._payloads[ref] = payload
        else:
            ref = self.calls.call(slot.actor, "process", unit.records)
        slot.queue.append((ref, unit))
        slot.uncommitted.update((r.sample_id, r) for r in unit.records)

    def _wait(self) -> None:
        heads = {s.queue[0][0]: i for i, s in enumerate(self.slots) if s.queue}
        timeout = None
        if self.unit_timeout is not None:
            now = time.monotonic()
            timeout = max(0.0, min(self.slots[i].started + self.unit_timeout - now for i in heads.values()))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self.tick_s if deadline is None else min(self.tick_s, max(0.0, deadline - time.monotonic()))
            ready = self.calls.wait(list(heads), left)
            if ready or (deadline is not None and time.monotonic() >= deadline):
                break
            self.on_tick(None)
        if not ready:  # the oldest running unit is past the timeout: treat its replica as hung
            i = min(heads.values(), key=lambda j: self.slots[j].started)
            self._fail(i, f"unit ran past --unit-timeout {self.unit_timeout:g} s", charge=True)
            return
        i = heads[ready[0]]
        slot = self.slots[i]
        ref, unit = slot.queue.pop(0)
        stats = self.stats[i]
        try:
            result = self.calls.get(ref)
        except ReplicaFailed as e:
            if _fatal(e.cause):
                raise e.cause from None
            slot.queue.insert(0, (ref, unit))
            self._fail(i, e.reason, charge=True)
            return
        now = time.monotonic()
        stats.units += 1
        stats.rows += result.rows
        stats.tokens += result.tokens
        stats.busy_seconds += now - slot.started
        stats.engine_seconds += result.engine_seconds
        stats.write_seconds += result.write_seconds
        slot.started = now
        for sample_id in result.rejected:
            slot.uncommitted.pop(sample_id, None)
        self._committed(slot, result.shards)
        payload = self._payloads.pop(ref, None)
        if result.payload is not None and self.sink.deliver(result.payload, payload):  # the delivery commits
            for sample_id in result.payload.sample_ids:
                slot.uncommitted.pop(sample_id, None)
        self.on_result(result)

    def _committed(self, slot: _Slot, infos: Sequence) -> None:
        self.sink.commit(infos)
        for info in infos:
            for sample_id in info.sample_ids:
                slot.uncommitted.pop(sample_id, None)

    def _fail(self, i: int, reason: str, *, charge: bool) -> None:
        """Replace replica ``i``; hand its uncommitted records out again (the running unit charged). When Ray
        has lost a node (now, or while the replacement waits for room: :meth:`_start`) and the live nodes
        cannot hold the replacement, the slot is dropped instead (:meth:`_drop`: a warning, the run goes on
        with fewer replicas, or stops with CaptureError when none is left; a rerun resumes)."""
        slot = self.slots[i]
        stats = self.stats[i]
        stats.lost_nodes += self.calls.lost_nodes()
        stats.restarts += 1
        stats.failures[reason] = stats.failures.get(reason, 0) + 1
        log.warning("replica %d failed (%s); replacing it and retrying its %d uncommitted record(s)",
                    i, reason, len(slot.uncommitted))
        self.calls.kill(slot.actor)
        for ref, _ in slot.queue:  # their payloads never come
            self._payloads.pop(ref, None)
        queued = [u for _, u in slot.queue]
        requeue: list[Unit] = []
        if charge and queued:
            head = queued.pop(0)
            head.attempts += 1
            head.last_error = reason
            requeue += self._after_failure(head)
        seen = {r.sample_id for u in requeue + queued for r in u.records} | set(self.quarantined)
        requeue += queued
        rest = [r for sid, r in slot.uncommitted.items() if sid not in seen]
        if rest:
            requeue.append(Unit(rest))
        self.retry = requeue + self.retry
        stats.units_redone += len(requeue)
        slot.queue, slot.uncommitted = [], {}
        slot.actor = self.make_actor()
        self._start([i])

    def _after_failure(self, unit: Unit) -> list[Unit]:
        """A failed unit: retried whole, split in halves, or (one record) quarantined."""
        if unit.attempts < self.max_attempts:
            return [unit]
        if len(unit.records) > 1:
            half = len(unit.records) // 2
            return [Unit(unit.records[:half]), Unit(unit.records[half:])]
        sample_id = unit.records[0].sample_id
        self.quarantined[sample_id] = unit.last_error
        log.error("quarantined %s after %d failed attempts: %s", sample_id, unit.attempts, unit.last_error)
        return []


def _fatal(cause: BaseException | None) -> bool:
    return isinstance(cause, CaptureError) or (isinstance(cause, OSError) and cause.errno == errno.ENOSPC)


def _reason(cause: BaseException) -> str:
    """One line naming what a replica raised: the exception's type and message."""
    text = " ".join(str(cause).split())[:200]
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__
