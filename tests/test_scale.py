"""Ray scale-out on the session's cluster (conftest.ray_cluster): two replicas, one killed mid-unit; a killed
driver. Real SmolLM2, the real Open-PerfectBlend sample, real Ray processes. A job submitted with Ray's job
API and lost worker nodes: tests/test_cluster.py (a multi-node cluster).

Every process a test starts carries ``CAPTURE_TEST_TAG`` in its environment (Ray's workers inherit it),
so a test finds and kills exactly its own processes, never another Ray instance on the machine.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, kill_tagged, tagged_pids
from shards import manifest as manifest_mod
from shards.verify import verify

pytestmark = [pytest.mark.ray, pytest.mark.model]  # real Ray replicas of SmolLM2

LIMIT = 24
SAMPLE_NAME = "open-perfectblend-sample.jsonl"


@pytest.fixture
def tag():
    t = uuid.uuid4().hex
    yield t
    kill_tagged(t)  # whatever a killed driver left behind


def run_cmd(out: Path, sample: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cli", "run", "--dataset", str(sample), "--layers", "3", "--out", str(out),
            "--limit", str(LIMIT), "--max-tokens", "384", "--overlength", "truncate", "--unit-tokens", "900",
            "--shard-size", "1MiB", "--no-progress", "--json", *extra]


def env_for(tag: str, cluster=None) -> dict:
    """A test process's environment: its tag, no progress bars, and the credentials of ``cluster`` (a
    conftest.RayCluster) when it connects to one."""
    return {**os.environ, "CAPTURE_TEST_TAG": tag, "TQDM_DISABLE": "1", **(cluster.env if cluster else {})}


def assert_exactly_once(out: Path) -> None:
    """Every sample of the first LIMIT rows committed exactly once; shards verify; no stray files."""
    m = manifest_mod.read(out)
    ids = [s for shard in m.shards for s in shard["sample_ids"]]
    assert sorted(ids) == sorted(f"{SAMPLE_NAME}:{i}" for i in range(LIMIT))
    report = verify(out)
    assert report.ok, report.problems
    assert report.rows == LIMIT and report.garbage == []
    assert m.complete


def kill_a_busy_replica(proc: subprocess.Popen, tag: str, title: str = "ray::Replica.process") -> int | None:
    """SIGKILL the first tagged replica seen running a unit (Ray's process title ``title``) half a second
    into it, while ``proc`` runs; its pid, or None when none was seen within 300 s."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        busy = tagged_pids(tag, title)
        if busy:
            time.sleep(0.5)  # well inside the unit
            os.kill(busy[0], signal.SIGKILL)
            return busy[0]
        time.sleep(0.2)
    return None


def test_replica_killed_mid_unit_run_completes_exactly_once(tmp_path, sample_jsonl, tag, ray_cluster):
    """One of two replicas on the session's cluster SIGKILLed half a second into a unit: it is replaced, its
    unit redone, every row committed exactly once."""
    out = tmp_path / "run"
    proc = subprocess.Popen(run_cmd(out, sample_jsonl, "--replicas", "2", "--cpus-per-replica", "1", "--ray-address",
                                    ray_cluster.address), cwd=REPO, env=env_for(tag, ray_cluster),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = kill_a_busy_replica(proc, ray_cluster.tag)
    stdout, stderr = proc.communicate(timeout=600)
    assert killed is not None, "no replica was ever seen processing a unit"
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout)
    assert sum(r["restarts"] for r in summary["replicas"]) == 1
    (failure,) = [f for r in summary["replicas"] for f in r["failures"]]
    assert failure == "replica process died"
    assert summary["quarantined"] == {} and summary["committed_rows"] == LIMIT
    assert sum(r["rows"] for r in summary["replicas"]) >= LIMIT  # the retried records count twice here
    t = summary["timings"]  # where the time went, for the summary line
    assert set(t) == {"prepare", "start", "engine", "write", "commit"}
    assert t["prepare"] > 0 and t["start"] > 0 and t["engine"] > 0 and t["write"] > 0
    assert t["engine"] <= sum(r["busy_seconds"] for r in summary["replicas"])
    assert_exactly_once(out)


def test_driver_killed_then_rerun_completes_exactly_once(tmp_path, sample_jsonl, tag, ray_cluster):
    """The driver of a run with a replica on the session's cluster SIGKILLed after its first commit: Ray ends
    the job's replica with it (none is left to write into the run), and the same command resumes, every row
    exactly once. (The in-process executor's driver:
    tests/test_run.py::test_sigkill_mid_run_then_rerun_is_exactly_once.)"""
    out = tmp_path / "run"
    cmd = run_cmd(out, sample_jsonl, "--replicas", "1", "--ray-address", ray_cluster.address)
    env = env_for(tag, ray_cluster)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not manifest_mod.read(out).shards and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    committed = sum(s["rows"] for s in manifest_mod.read(out).shards)
    assert 0 < committed < LIMIT, f"the driver should die mid-run ({committed} rows committed)"
    proc.kill()  # SIGKILL: no cleanup, no completion record
    proc.wait()
    assert not manifest_mod.read(out).complete
    deadline = time.monotonic() + 60
    while tagged_pids(ray_cluster.tag, "ray::Replica") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tagged_pids(ray_cluster.tag, "ray::Replica"), "a replica outlived its killed driver by 60 s"

    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout)
    assert summary["already_committed"] == committed
    assert summary["committed_rows"] == LIMIT - committed
    assert_exactly_once(out)


