"""Ray scale-out: two replicas, a replica killed mid-unit, a killed driver, a job submitted to a real Ray
head with Ray's job API. Real SmolLM2, the real Open-PerfectBlend sample, real Ray processes.

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

from conftest import REPO, forget_ray_head, free_port, kill_tagged, start_ray_head, start_ray_worker, tagged_pids
from shards import manifest as manifest_mod
from shards.verify import verify

pytestmark = [pytest.mark.ray, pytest.mark.model]  # real Ray replicas of SmolLM2

LIMIT = 24
SAMPLE_NAME = "open-perfectblend-sample.jsonl"


@pytest.fixture
def tag():
    t = uuid.uuid4().hex
    yield t
    kill_tagged(t)  # whatever a killed driver or a test's Ray head left behind


@pytest.fixture
def ray_head_port():
    """A free port for a test's `ray start --head`; afterwards the address file `ray start` leaves in
    /tmp/ray is removed when it names this head (`ray stop` would stop every Ray on the machine)."""
    port = free_port()
    yield port
    forget_ray_head(port)


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


def test_replica_killed_mid_unit_run_completes_exactly_once(tmp_path, sample_jsonl, tag):
    out = tmp_path / "run"
    proc = subprocess.Popen(run_cmd(out, sample_jsonl, "--replicas", "2", "--cpus-per-replica", "1"), cwd=REPO,
                            env=env_for(tag), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = kill_a_busy_replica(proc, tag)
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


def test_driver_killed_then_rerun_completes_exactly_once(tmp_path, sample_jsonl, tag):
    out = tmp_path / "run"
    cmd = run_cmd(out, sample_jsonl)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env_for(tag), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not manifest_mod.read(out).shards and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    committed = sum(s["rows"] for s in manifest_mod.read(out).shards)
    assert 0 < committed < LIMIT, f"the driver should die mid-run ({committed} rows committed)"
    proc.kill()  # SIGKILL: no cleanup, no completion record
    proc.wait()
    assert not manifest_mod.read(out).complete

    again = subprocess.run(cmd, cwd=REPO, env=env_for(tag), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout)
    assert summary["already_committed"] == committed
    assert summary["committed_rows"] == LIMIT - committed
    assert_exactly_once(out)


def test_ray_job_submit_two_replicas(tmp_path, sample_jsonl, tag, ray_head_port):
    """The README's cluster recipe: `ray start --head`, then `ray job submit -- capture run --ray-address auto`."""
    port, dash = ray_head_port, free_port()
    # Ray >= 2.59 authenticates local clusters with a token: the head and `ray job submit` share one
    env = {**env_for(tag), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    ray_bin = str(Path(sys.executable).with_name("ray"))
    start = start_ray_head(port, env, dashboard_port=dash)
    assert start.returncode == 0, start.stderr[-3000:]
    out = tmp_path / "run"
    cmd = run_cmd(out, sample_jsonl, "--replicas", "2", "--cpus-per-replica", "1", "--ray-address", "auto")
    deadline = time.monotonic() + 120
    while True:  # the head's job agent comes up a few seconds after `ray start` returns
        job = subprocess.run([ray_bin, "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--", *cmd],
                             env=env, capture_output=True, text=True, timeout=900)
        if "No available agent" not in job.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    logs = job.stdout
    assert "succeeded" in logs
    summary = json.JSONDecoder().raw_decode(logs[logs.rfind("\n{\n") + 1:])[0]  # the run's JSON summary
    assert [r["replica"] for r in summary["replicas"]] == [0, 1]
    assert all(r["units"] > 0 for r in summary["replicas"])  # both replicas took work
    assert_exactly_once(out)


def test_a_lost_worker_node_leaves_the_run_to_the_nodes_that_remain(tmp_path, sample_jsonl, tag, ray_head_port):
    """A real multi-node cluster on this machine: a head without CPUs (the driver's node: the progress feed
    lives there) and two worker nodes of 1 CPU, one replica each. Worker node A is SIGKILLed whole (raylet
    and every worker) while its replica runs a unit: its replica cannot be placed again (B is full), so the
    run drops it with a warning and completes on B, every row exactly once; the summary names the node."""
    port = ray_head_port
    env = {**env_for(tag), "RAY_AUTH_MODE": "token"}
    ray_bin = str(Path(sys.executable).with_name("ray"))
    subprocess.run([ray_bin, "get-auth-token", "--generate"], capture_output=True, timeout=120, check=True)
    assert start_ray_head(port, env, num_cpus=0).returncode == 0
    node_a = f"{tag}-a"  # a tag of its own: kill_tagged(node_a) is the whole node
    for node in (node_a, tag):
        started = start_ray_worker(f"127.0.0.1:{port}", {**env, "CAPTURE_TEST_TAG": node}, 1)
        assert started.returncode == 0, started.stderr[-2000:]
    out = tmp_path / "run"
    proc = subprocess.Popen(run_cmd(out, sample_jsonl, "--replicas", "2", "--cpus-per-replica", "1", "--ray-address",
                                    f"127.0.0.1:{port}"), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not tagged_pids(node_a, "ray::Replica.process") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tagged_pids(node_a, "ray::Replica.process"), "node A's replica was never seen running a unit"
        time.sleep(0.5)  # inside the unit
        kill_tagged(node_a)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        kill_tagged(node_a)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    summary = json.loads(stdout)
    lost = [r for r in summary["replicas"] if r["lost_nodes"]]
    assert len(lost) == 1 and "no live node had room" in lost[0]["dropped"] and lost[0]["units_redone"] >= 1
    assert "no live node has room to replace it: going on with 1 replica(s)" in stderr
    assert_exactly_once(out)
