"""capture.pool.ReplicaPool with real Ray actors (and in-process replicas) whose behaviour a test controls:
a unit that raises every time (split, then its one bad record quarantined; both executors), a replica that
hangs (Ray: killed at the unit timeout and replaced), exactly-once commits throughout. A slow replica shows the live display moving before its first unit completes. The real engine replica is
exercised by tests/test_scale.py."""

import dataclasses
import io
import sys
import time
import uuid
from pathlib import Path

import pytest
import ray
import ray.cloudpickle

from common.errors import CaptureError
from capture.executor import on_driver_node
from capture.pool import LocalActor, LocalCalls, ReplicaPool
from capture.progress import Progress, feed
from capture.replica import UnitResult
from capture.sinks import Output
from shards.writer import ShardInfo


@dataclasses.dataclass(frozen=True)
class Rec:
    sample_id: str
    num_tokens: int = 10


class ScriptedReplica:
    """Writes one shard per unit, unless the unit holds a ``poison`` record (raises) or a ``hang`` record
    seen for the first time (sleeps far past the unit timeout; ``marker`` remembers across actors)."""

    def __init__(self, poison: set, hang: set, marker: str):
        self.poison, self.hang, self.marker = poison, hang, Path(marker)

    def start(self) -> str:
        return "scripted"

    def process(self, records):
        ids = [r.sample_id for r in records]
        if self.poison & set(ids):
            raise RuntimeError(f"cannot process {sorted(self.poison & set(ids))}")
        for sid in self.hang & set(ids):
            flag = self.marker / sid
            if not flag.exists():
                flag.touch()
                time.sleep(600)
        info = ShardInfo(f"shard-{uuid.uuid4().hex}.arrow", len(ids), 10 * len(ids), 5 * len(ids), 100, "0" * 64,
                         tuple(ids), tuple("0" * 64 for _ in ids))
        return UnitResult([info], {}, 10 * len(ids), len(ids))

    def finish(self):
        return []


@pytest.fixture(scope="module")
def local_ray(ray_cluster):
    """This process connected to the session's Ray cluster for the module (conftest.ray_cluster)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    with ray_cluster.connect():
        yield


class Collect:
    """A sink (:mod:`capture.sinks`' interface, shards only) that keeps the sample ids of every shard committed."""

    output = Output()

    def __init__(self):
        self.committed: list[str] = []

    def commit(self, infos) -> None:
        self.committed.extend(s for i in infos for s in i.sample_ids)


def run_pool(tmp_path, units, *, poison=(), hang=(), timeout=None, attempts=2, local=False):
    """Two Ray replicas, or (``local``) one replica in this process."""
    sink = Collect()
    if local:
        make, replicas, calls = lambda: LocalActor(ScriptedReplica(set(poison), set(hang), str(tmp_path))), 1, LocalCalls()
    else:
        actor = ray.remote(num_cpus=0)(ScriptedReplica)
        make, replicas, calls = lambda: actor.remote(set(poison), set(hang), str(tmp_path)), 2, None
    pool = ReplicaPool(make, replicas, sink=sink, on_result=lambda r: None, unit_timeout=timeout,
                       max_attempts=attempts, calls=calls)
    for unit in units:
        pool.submit(unit)
    pool.finish()
    return pool, sink.committed


def units_of(n_units: int, size: int) -> list[list[Rec]]:
    return [[Rec(f"s{u}-{i}") for i in range(size)] for u in range(n_units)]


@pytest.mark.parametrize("local", [False, True], ids=["ray", "local"])
def test_failing_unit_is_split_and_its_bad_record_quarantined(local_ray, tmp_path, local):
    units = units_of(6, 4)
    pool, committed = run_pool(tmp_path, units, poison={"s2-1"}, attempts=2, local=local)
    everyone = [r.sample_id for u in units for r in u]
    assert sorted(committed) == sorted(s for s in everyone if s != "s2-1")  # every other record exactly once
    assert list(pool.quarantined) == ["s2-1"]
    assert pool.quarantined["s2-1"] == "RuntimeError: cannot process ['s2-1']"
    # 2 attempts of the 4-record unit, then of its half [s2-0, s2-1], then of [s2-1] alone
    failures = sum(sum(s.failures.values()) for s in pool.stats)
    assert failures == 6 and sum(s.restarts for s in pool.stats) == 6


def test_in_process_replica_refuses_a_unit_timeout(tmp_path):
    """A running in-process unit cannot be stopped: --unit-timeout is refused, not silently ignored."""
    with pytest.raises(CaptureError, match="--unit-timeout needs replicas in processes of their own"):
        run_pool(tmp_path, units_of(1, 2), timeout=3, local=True)


def test_hung_replica_is_replaced_at_the_timeout(local_ray, tmp_path):
    units = units_of(4, 3)
    t = time.monotonic()
    pool, committed = run_pool(tmp_path, units, hang={"s1-2"}, timeout=3)
    assert time.monotonic() - t < 60
    assert sorted(committed) == sorted(r.sample_id for u in units for r in u)
    assert pool.quarantined == {}
    reasons = {k: v for s in pool.stats for k, v in s.failures.items()}
    assert reasons == {"unit ran past --unit-timeout 3 s": 1}


class SlowReplica:
    """Loads its engine for 2 s, then runs each unit as 3 forward batches of 1 s, putting each batch's 10
    tokens on the progress feed as the real replica does (capture.replica.Replica._report)."""

    def __init__(self, feed):
        self.feed = feed

    def start(self) -> str:
        time.sleep(2.0)
        return "slow"

    def process(self, records):
        for _ in range(3):
            time.sleep(1.0)
            self.feed.put_nowait(10)
        ids = [r.sample_id for r in records]
        info = ShardInfo(f"shard-{uuid.uuid4().hex}.arrow", len(ids), 30, 15, 100, "0" * 64, tuple(ids),
                         tuple("0" * 64 for _ in ids))
        return UnitResult([info], {}, 30, len(ids), engine_seconds=3.0)

    def finish(self):
        return []


def test_progress_moves_before_the_first_unit_completes(local_ray):
    """The display names the engine load while it runs, redraws at least every tick, and counts tokens per
    forward batch: 10 and 20 tokens are on screen before the first (30-token) unit completes."""
    screen = io.StringIO()
    progress = Progress(True, file=screen, interval=0.2)  # a terminal's rate (StringIO is no tty)
    progress.feed = feed(on_driver_node())
    ticks, at_first_result = [], []

    def on_tick(status):
        progress.tick(status)
        ticks.append((progress.tokens, progress.description))

    def on_result(result):
        if not at_first_result:
            at_first_result.append((progress.tokens, len(ticks), screen.getvalue()))

    actor = ray.remote(num_cpus=0)(SlowReplica)
    pool = ReplicaPool(lambda: actor.remote(progress.feed), 1, sink=Collect(), on_result=on_result,
                       on_tick=on_tick, tick_s=0.2)
    pool.submit(units_of(1, 3)[0])
    pool.finish()
    progress.close()

    loading = [t for t in ticks if t[1] == "capture [loading the engine on 1 replica(s), 0 ready]"]
    assert len(loading) >= 5  # 2 s of engine load, a redraw every 0.2 s
    assert pool.start_seconds >= 2.0 and pool.stats[0].engine_seconds == 3.0
    tokens_before, ticks_before, shown_before = at_first_result[0]
    assert {10, 20} <= {tok for tok, _ in ticks[:ticks_before]}  # per batch, before the unit's result
    assert "10.0tok" in shown_before and "20.0tok" in shown_before and "capture [capturing]" in shown_before
    assert progress.tokens == 30
    assert screen.getvalue().endswith("]\n")  # closed on its own line: an error printed next starts a new one
