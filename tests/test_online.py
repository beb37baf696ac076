"""Online runs (capture.online, shards.online): rows from live Ray replicas straight to a trainer, never to
disk. Real SmolLM2, the real Open-PerfectBlend sample, real Ray processes; the trainer is
tests/online_trainer.py in a process of its own. The replicas run on the session's cluster
(conftest.ray_cluster: every replica on it is the running test's, so a test kills exactly its own)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, capture_process
from shards import manifest as manifest_mod
from shards import live
from shards.run import as_location
from shards.stream import ShardStream
from shards.verify import verify
from test_scale import SAMPLE_NAME, env_for, kill_a_busy_replica, tag  # noqa: F401 - fixtures

import online_trainer

pytestmark = [pytest.mark.ray, pytest.mark.model]  # every test runs Ray replicas of SmolLM2

LIMIT = 16


def trainer(out, sample, tag_, *extra: str, cluster) -> subprocess.Popen:
    """tests/online_trainer.py in a process of its own, connected to ``cluster`` (the session's,
    conftest.ray_cluster)."""
    cmd = [sys.executable, str(REPO / "tests" / "online_trainer.py"), "--out", str(out), "--dataset", str(sample),
           "--limit", str(LIMIT), *extra, "--ray-address", cluster.address]
    return subprocess.Popen(cmd, cwd=REPO, env=env_for(tag_, cluster), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def lines_of(stdout: str) -> tuple[list[dict], dict | None]:
    rows = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    summary = next((r for r in rows if "summary" in r), None)
    return [r for r in rows if "id" in r], summary


def test_online_rows_equal_an_offline_run_bit_for_bit_through_a_replica_kill(tmp_path, sample_jsonl, tag, ray_cluster):
    """The same rows captured offline (one replica in the driver's process with 1 CPU thread, as each online
    replica has; tests/test_run.py shows Ray and in-process replicas write identical shards) and online with
    --keep for 2 trainer ranks from 2 Ray replicas, one of which is SIGKILLed half a second into a unit: the
    same ids, each exactly once, with bit-identical input ids, taps, final state and argmax. The dead
    replica's unit is redone (one restart) and the rows of its open shard are captured again for the shards
    but not sent to a rank twice. Rank 0 reads in the capture's process, rank 1 in a process of its own that
    attaches by the run folder (nothing about the cluster in its environment: the endpoint and Ray's local
    token file are enough) and decodes in 2 spawned DataLoader workers. Every row reaches exactly one rank,
    bit for bit as offline and as the tee's shards hold it; both workers get rows and both stop at the end;
    the capture's process waits for the attached rank's acks before it closes the queues. A DataLoader worker
    forked from the capture's (Ray-connected) process is refused in one line before it takes a unit. (One
    online capture serves all of this; an online run without shards leaves none: the trainer-killed test.)"""
    offline = tmp_path / "offline"
    capture_process("run", "--target", "smollm2-135m", "--dataset", str(sample_jsonl), "--layers", "3,15", "--final",
                    "post-norm", "--limit", str(LIMIT), "--max-tokens", "256", "--overlength", "truncate", "--executor",
                    "local", "--cpus-per-replica", "1", "--unit-tokens", "600", "--out", str(offline), "--no-progress",
                    check=True)
    want = {s["sample_id"]: online_trainer.digest(s) for s in ShardStream(offline)}
    assert sorted(want) == sorted(f"{SAMPLE_NAME}:{i}" for i in range(LIMIT))

    # --keep for 2 ranks: the same rows to the trainer ranks, and shards equal to the offline run's row for row
    tee = tmp_path / "tee"
    rank1 = subprocess.Popen([sys.executable, str(REPO / "tests" / "online_trainer.py"), "--out", str(tee),
                              "--dataset", str(sample_jsonl), "--limit", str(LIMIT), "--attach", "1", "--workers", "2"],
                             cwd=REPO, env=without_ray_auth(env_for(tag)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    rank0 = trainer(tee, sample_jsonl, tag, "--world-size", "2", "--keep", "--try-fork", cluster=ray_cluster)
    killed = kill_a_busy_replica(rank0, ray_cluster.tag, "ray::Replica.process_with_payload")
    stdout0, stderr0 = rank0.communicate(timeout=600)
    stdout1, stderr1 = rank1.communicate(timeout=600)
    assert rank0.returncode == 0, stderr0[-3000:]
    assert rank1.returncode == 0, stderr1[-3000:]
    rows0, end = lines_of(stdout0)
    rows1 = [json.loads(x) for x in stdout1.splitlines() if x.startswith('{"id"')]
    refused = [json.loads(x)["fork_refused"] for x in stdout0.splitlines() if x.startswith('{"fork_refused"')]
    assert refused == ["common.errors.CaptureError: a DataLoader worker forked from a process connected to Ray "
                       "cannot use that connection: pass multiprocessing_context='spawn' to the DataLoader"]
    assert rows0 and rows1
    assert sorted(r["id"] for r in rows0 + rows1) == all_ids()  # each row to one rank, once
    assert {r["id"]: r["sha"] for r in rows0 + rows1} == want
    assert {r["id"]: r["sha"] for r in rows0 + rows1} == {s["sample_id"]: online_trainer.digest(s)
                                                          for s in ShardStream(tee)}
    assert {s["sample_id"]: online_trainer.digest(s) for s in ShardStream(tee)} == want
    assert len({r["pid"] for r in rows1}) == 2 and rank1.pid not in {r["pid"] for r in rows1}
    assert json.loads(stdout1.splitlines()[-1]) == {"attached": 1, "rows": len(rows1)}
    assert live.acked_ids(as_location(tee)) == set(all_ids())
    assert end["summary"]["committed_rows"] == LIMIT
    assert killed is not None, "no replica was ever seen processing a unit"
    assert sum(r["restarts"] for r in end["summary"]["replicas"]) == 1
    assert [f for r in end["summary"]["replicas"] for f in r["failures"]] == ["replica process died"]
    assert_tee(tee)
    assert manifest_mod.read(tee).completions[-1]["online"] == "tee"


def without_ray_auth(env: dict) -> dict:
    """``env`` less Ray's authentication settings (a trainer rank started by hand has none)."""
    return {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}


def all_ids() -> list[str]:
    return sorted(f"{SAMPLE_NAME}:{i}" for i in range(LIMIT))


def assert_tee(out) -> None:
    """A --keep run's shards: every row once, verified, complete."""
    report = verify(out)
    assert report.ok and report.complete and report.rows == LIMIT, report.problems
    assert sorted(s["sample_id"] for s in ShardStream(out)) == all_ids()


@pytest.mark.parametrize("keep", [False, True], ids=["no-shards-self-distillation", "keep"])
def test_trainer_killed_after_a_checkpoint_resumes_exactly_once(tmp_path, sample_jsonl, tag, keep, ray_cluster):
    """The trainer acks every 2 samples and dies hard after acking 6; the restarted trainer (a new online
    capture of the same run folder) gets exactly the other rows: without shards they are captured again,
    with --keep the committed ones come from the shards and the rest are captured. The run without shards
    is a self-distillation one (--responses regenerate online, one capture serving both checks): the
    replicas generate the last answer (at most 8 tokens) before they capture, the rows arrive with exactly
    the generated tokens supervised, and provenance.json records the complete invocation."""
    out = tmp_path / "online"
    tee = ["--keep"] if keep else ["--regenerate", "8"]
    one = ["--replicas", "1"]  # the fault is the trainer's: one replica is enough
    first = trainer(out, sample_jsonl, tag, "--ack-every", "2", "--crash-after", "6", *tee, *one, cluster=ray_cluster)
    stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 3, stderr[-3000:]
    before = [r["id"] for r in lines_of(stdout)[0]]
    assert len(before) == 6 and live.acked_ids(as_location(out)) == set(before)
    assert not manifest_mod.read(out).complete

    second = trainer(out, sample_jsonl, tag, *tee, *one, cluster=ray_cluster)
    stdout, stderr = second.communicate(timeout=600)
    assert second.returncode == 0, stderr[-3000:]
    rows, end = lines_of(stdout)
    after = [r["id"] for r in rows]
    assert not set(before) & set(after)
    assert sorted(before + after) == all_ids()
    if keep:  # the shards hold every row once; this run captured only what the first had not committed
        assert_tee(out)
        assert end["summary"]["already_committed"] + end["summary"]["committed_rows"] == LIMIT
        assert manifest_mod.read(out).completions[-1]["online"] == "tee"
    else:  # nothing on disk but the log: no shard, the manifest complete, every row acked
        assert end["summary"]["already_committed"] == 6 and end["summary"]["committed_rows"] == LIMIT - 6
        assert end["summary"]["shards"] == 0 and not list(out.glob("*.arrow"))
        m = manifest_mod.read(out)
        assert m.complete and m.all_shards == [] and live.acked_ids(as_location(out)) == set(all_ids())
        assert m.header.mode == "regenerate" and m.completions[-1]["online"] == "deliver"
        assert all(1 <= r["loss_tokens"] <= 8 for r in rows)
        assert json.loads((out / "provenance.json").read_text())["invocations"][-1]["status"] == "complete"


def test_attach_refuses_in_one_line(tmp_path, reader_run):
    """attach without a running capture, for a rank the run does not serve, or with the endpoint of a run
    whose Ray cluster is gone (a port nobody listens on: answered at once, not after Ray's retries): a
    one-line CaptureError."""
    from common.errors import CaptureError
    from shards.live import ENDPOINT
    from shards.online import attach

    with pytest.raises(CaptureError, match=r"no online-endpoint.json in .*start the capture .* first \(waited 0 s\)"):
        attach(tmp_path, 0, wait_s=0)
    (tmp_path / ENDPOINT).write_text(json.dumps({"address": "127.0.0.1:1", "namespace": "capture-online",
                                                 "queues": ["a", "b"], "world_size": 2, "auth_mode": None}))
    with pytest.raises(CaptureError, match=r"rank 2 is not in \[0, world_size=2\)"):
        attach(tmp_path, 2, wait_s=0)
    with pytest.raises(CaptureError, match="has not written its header yet"):
        attach(tmp_path, 1, wait_s=0)
    header = next(x for x in (reader_run / "manifest.jsonl").read_text().splitlines() if '"header"' in x)
    (tmp_path / "manifest.jsonl").write_text(header + "\n")
    assert manifest_mod.read(tmp_path).header is not None
    with pytest.raises(CaptureError, match=r"the Ray cluster or queues named in .*online-endpoint.json are gone"):
        attach(tmp_path, 1, wait_s=0)
