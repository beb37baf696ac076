"""A real multi-node Ray cluster on this machine, as a cluster user starts one: a head with no CPU (the
driver's node: the progress feed and online queues live there; its dashboard takes `ray job submit`) and
worker nodes joined with `ray start --address`: a job submitted with Ray's job API that loses a worker node, an
online run that loses one, a worker node that holds another model. Node B (1 CPU) lives for the module; each
test starts its own node A (a tag of its own, so that :func:`conftest.kill_tagged` takes the whole node down,
raylet and every worker, as a lost machine) and kills it at the end. Real SmolLM2, the real Open-PerfectBlend
sample. One cluster for the module saves a head and a node start per test (~10-20 s each on 2 cores). A node
killed at the end of one test may not be marked dead yet when the next run places a replica on it: that
replica dies while starting and is placed again (so a replica besides the dropped one may list a lost node)."""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from conftest import (REPO, RAY_BIN, RayCluster, forget_ray_head, free_port, kill_tagged, start_ray_head,
                      start_ray_worker, tagged_pids)
from test_online import LIMIT as ONLINE_LIMIT, all_ids, assert_tee, lines_of
from test_scale import assert_exactly_once, env_for, run_cmd

pytestmark = [pytest.mark.ray, pytest.mark.model]  # real Ray nodes and replicas of SmolLM2

@pytest.fixture(scope="module")
def cluster():
    """A head (0 CPUs, dashboard) and worker node B (1 CPU) for the module; Ray's token authentication with the
    token file ``ray get-auth-token --generate`` leaves in ~/.ray (what `ray job submit` and an attaching
    trainer rank read). Killed at the end of the module."""
    tag, port, dash = uuid.uuid4().hex, free_port(), free_port()
    cluster = RayCluster(f"127.0.0.1:{port}", {"RAY_AUTH_MODE": "token"}, tag, dashboard=f"http://127.0.0.1:{dash}")
    try:
        subprocess.run([RAY_BIN, "get-auth-token", "--generate"], capture_output=True, timeout=120, check=True)
        head = start_ray_head(port, env_for(tag, cluster), num_cpus=0, dashboard_port=dash)
        assert head.returncode == 0, head.stderr[-3000:]
        node_b = start_ray_worker(cluster.address, env_for(tag, cluster), 1)
        assert node_b.returncode == 0, node_b.stderr[-3000:]
        yield cluster
    finally:
        kill_tagged(tag)
        forget_ray_head(port)


@pytest.fixture
def node_a(cluster):
    """A 1-CPU worker node of this test's own, joined to ``cluster``: its tag (every process of the node
    carries it). Killed at the end of the test, if the test has not lost it already."""
    node = f"{cluster.tag}-a-{uuid.uuid4().hex[:8]}"
    try:
        started = start_ray_worker(cluster.address, env_for(node, cluster), 1)
        assert started.returncode == 0, started.stderr[-2000:]
        yield node
    finally:
        kill_tagged(node)


def lose_node_mid_unit(proc: subprocess.Popen, node: str, title: str) -> None:
    """SIGKILL every process of ``node`` half a second after its replica (Ray's process title ``title``) is
    seen running a unit, while ``proc`` runs; fails the test if that is never seen within 300 s."""
    deadline = time.monotonic() + 300
    while not tagged_pids(node, title) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not tagged_pids(node, title):
        proc.kill()
        pytest.fail(f"node A's replica was never seen running a unit ({title}): {proc.communicate()[1][-3000:]}")
    time.sleep(0.5)  # inside the unit
    kill_tagged(node)


def wait_for_the_job_agent(cluster: RayCluster) -> None:
    """Until the head's job agent takes jobs (it comes up a few seconds after `ray start` returns; a submit
    before it is refused with "No available agent"): a job of ``true``, at most 120 s."""
    deadline = time.monotonic() + 120
    while True:
        probe = subprocess.run([RAY_BIN, "job", "submit", "--address", cluster.dashboard, "--", "true"],
                               env=env_for(cluster.tag, cluster), capture_output=True, text=True, timeout=300)
        if probe.returncode == 0 or "No available agent" not in probe.stderr or time.monotonic() > deadline:
            assert probe.returncode == 0, (probe.stdout + probe.stderr)[-3000:]
            return
        time.sleep(3)


def test_a_job_submitted_to_the_cluster_goes_on_when_a_worker_node_is_lost(tmp_path, sample_jsonl, cluster, node_a):
    """The README's cluster recipe, `ray job submit -- capture run --ray-address auto` (the entrypoint runs on
    the head, one replica on each worker node), and a node lost under it: worker node A is SIGKILLed whole
    (raylet and every worker) while its replica runs a unit. That replica cannot be placed again (B is full,
    the head has no CPU), so the run drops it with a warning and completes on B: the job succeeds, every row
    exactly once, the summary names the node and the units redone."""
    out = tmp_path / "run"
    cmd = run_cmd(out, sample_jsonl, "--replicas", "2", "--cpus-per-replica", "1", "--ray-address", "auto")
    wait_for_the_job_agent(cluster)
    job = subprocess.Popen([RAY_BIN, "job", "submit", "--address", cluster.dashboard, "--", *cmd],
                           env=env_for(cluster.tag, cluster), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lose_node_mid_unit(job, node_a, "ray::Replica.process")
    logs, stderr = job.communicate(timeout=600)  # the entrypoint's stdout and stderr come in `ray job submit`'s stdout
    assert job.returncode == 0, (logs + stderr)[-3000:]
    assert "succeeded" in logs and "Traceback" not in logs
    summary = json.JSONDecoder().raw_decode(logs[logs.rfind("\n{\n") + 1:])[0]  # the run's JSON summary
    assert [r["replica"] for r in summary["replicas"]] == [0, 1]
    (dropped,) = [r for r in summary["replicas"] if r["dropped"]]
    assert "no live node had room" in dropped["dropped"] and dropped["lost_nodes"] and dropped["units_redone"] >= 1
    assert "no live node has room to replace it: going on with 1 replica(s)" in logs
    assert_exactly_once(out)


def test_a_lost_worker_node_online_delivers_every_row_once(tmp_path, sample_jsonl, cluster, node_a):
    """The lost node, online with --keep (tests/online_trainer.py: the trainer's queue lives on the head).
    The trainer gets every row once, the tee's shards verify, the summary names the lost node."""
    out = tmp_path / "online"
    cmd = [sys.executable, str(REPO / "tests" / "online_trainer.py"), "--out", str(out), "--dataset", str(sample_jsonl),
           "--limit", str(ONLINE_LIMIT), "--keep", "--ray-address", cluster.address]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env_for(cluster.tag, cluster), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lose_node_mid_unit(proc, node_a, "ray::Replica.process_with_payload")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    rows, end = lines_of(stdout)
    assert sorted(r["id"] for r in rows) == all_ids()  # none lost, none twice
    (dropped,) = [r for r in end["summary"]["replicas"] if r["dropped"]]
    assert dropped["lost_nodes"] and dropped["units_redone"] >= 1
    assert_tee(out)


def test_a_worker_node_with_another_model_config_stops_the_run_before_any_row(tmp_path, smol_dir, sample_jsonl,
                                                                                cluster):
    """A 2-CPU worker node whose processes see a copy of SmolLM2's folder with another config.json at the same
    path (a mount namespace of its own, as a node set up by hand would). The one replica asks for 2 CPUs, which
    only that node has: it lands there, refuses, and the run ends with exit 2, one line, and no shard
    committed (issue 33 part 3; the fingerprint itself: tests/test_identity.py)."""
    other = smol_dir.parent / f".mismatch-{uuid.uuid4().hex[:8]}"  # beside it: hard links to the same weights
    other.mkdir()
    node = f"{cluster.tag}-m-{uuid.uuid4().hex[:8]}"
    try:
        for f in smol_dir.iterdir():
            os.link(f, other / f.name) if f.name != "config.json" else None
        config = json.loads((smol_dir / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "edited_by_hand": True}))  # still loads
        started = start_ray_worker(cluster.address, env_for(node, cluster), 2, bind=(other, smol_dir))
        assert started.returncode == 0, started.stderr[-2000:]
        out = tmp_path / "run"
        proc = subprocess.run([sys.executable, "-m", "cli", "run", "--out", str(out), "--dataset", str(sample_jsonl),
                               "--limit", "4", "--max-tokens", "128", "--overlength", "truncate", "--no-progress",
                               "--ray-address", cluster.address, "--replicas", "1", "--cpus-per-replica", "2"],
                              cwd=REPO, env=env_for(cluster.tag, cluster), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "config.json differ; it wrote nothing" in errors[0], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert not list(out.glob("shard-*.arrow")) and '"kind": "shard"' not in (out / "manifest.jsonl").read_text()
    finally:
        kill_tagged(node)
        shutil.rmtree(other, ignore_errors=True)
