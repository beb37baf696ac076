"""capture.pool.ReplicaPool with real Ray actors whose behaviour a test controls: a unit that raises every
time (split, then its one bad record quarantined), a replica that hangs (killed at the unit timeout and
replaced), exactly-once commits throughout. The real engine replica is exercised by tests/test_scale.py."""

import dataclasses
import sys
import time
import uuid
from pathlib import Path

import pytest
import ray
import ray.cloudpickle

from capture.pool import ReplicaPool
from capture.replica import UnitResult
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
def local_ray():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def run_pool(tmp_path, units, *, poison=(), hang=(), timeout=None, attempts=2):
    actor = ray.remote(num_cpus=0)(ScriptedReplica)
    committed = []
    pool = ReplicaPool(lambda: actor.remote(set(poison), set(hang), str(tmp_path)), 2,
                       commit=lambda infos: committed.extend(s for i in infos for s in i.sample_ids),
                       on_result=lambda r: None, unit_timeout=timeout, max_attempts=attempts)
    for unit in units:
        pool.submit(unit)
    pool.finish()
    return pool, committed


def units_of(n_units: int, size: int) -> list[list[Rec]]:
    return [[Rec(f"s{u}-{i}") for i in range(size)] for u in range(n_units)]


def test_failing_unit_is_split_and_its_bad_record_quarantined(local_ray, tmp_path):
    units = units_of(6, 4)
    pool, committed = run_pool(tmp_path, units, poison={"s2-1"}, attempts=2)
    everyone = [r.sample_id for u in units for r in u]
    assert sorted(committed) == sorted(s for s in everyone if s != "s2-1")  # every other record exactly once
    assert list(pool.quarantined) == ["s2-1"]
    assert pool.quarantined["s2-1"] == "RuntimeError: cannot process ['s2-1']"
    # 2 attempts of the 4-record unit, then of its half [s2-0, s2-1], then of [s2-1] alone
    failures = sum(sum(s.failures.values()) for s in pool.stats)
    assert failures == 6 and sum(s.restarts for s in pool.stats) == 6


def test_hung_replica_is_replaced_at_the_timeout(local_ray, tmp_path):
    units = units_of(4, 3)
    t = time.monotonic()
    pool, committed = run_pool(tmp_path, units, hang={"s1-2"}, timeout=3)
    assert time.monotonic() - t < 60
    assert sorted(committed) == sorted(r.sample_id for u in units for r in u)
    assert pool.quarantined == {}
    reasons = {k: v for s in pool.stats for k, v in s.failures.items()}
    assert reasons == {"unit ran past --unit-timeout 3 s": 1}
