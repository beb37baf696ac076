"""A full disk, everywhere something writes (issue 33 part 2), on real tmpfs mounts (conftest.small_disk),
with the guarantee `capture run` has (tests/test_run.py::test_disk_full_stops_cleanly_then_resumes): one line,
nothing half-written or lost, and the same command completes once there is space. `shards recode` resumes;
`export` removes its partial folder and says how much it needs; the drafter keeps its last good checkpoint
and, when the run's disk cannot take its ack, keeps the checkpoint and acks again on the rerun."""

from __future__ import annotations

import json
import subprocess

import helpers
import numpy as np
import pytest
import torch

from conftest import capture_cli, small_disk
from shards import manifest
from shards.reader import iter_rows
from shards.verify import verify


def grow(disk, size: str = "64M") -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)


def test_recode_stops_cleanly_on_a_full_disk_then_resumes(tmp_path):
    src, _ = helpers.drafter_run(tmp_path / "src", 24, tokens=256, hidden=64, vocab=512, shard_bytes=64 << 10)
    with small_disk(tmp_path / "disk", "512k") as disk:  # the recoded run needs ~1.5 MiB
        dst = disk / "bf16"
        args = ["shards", "recode", str(src), str(dst), "--codec", "bf16", "--shard-size", "64KiB"]
        full = capture_cli(*args)
        assert full.returncode == 2 and "is full" in full.stderr and "stopped cleanly" in full.stderr, full.stderr
        assert "Traceback" not in full.stderr and len(full.stderr.strip().splitlines()) == 1
        first = manifest.read(dst)
        assert 0 < first.rows < 24 and not first.complete and verify(dst).ok
        assert not [p for p in dst.iterdir() if p.name.startswith(".tmp-")]
        grow(disk)
        again = capture_cli(*args, check=True)
        assert f"({len(first.sample_ids())} already there)" in again.stdout
        done = manifest.read(dst)
        assert done.complete and verify(dst).ok and done.rows == 24
        ids = [sid for s in done.shards for sid in s["sample_ids"]]
        assert len(ids) == len(set(ids)) == 24  # every row once
        source = {r["sample_id"]: r for r in iter_rows(src)}
        for row in iter_rows(dst):  # lossless: the same rows, bit for bit
            want = source[row["sample_id"]]
            assert np.array_equal(row["input_ids"], want["input_ids"])
            assert all(torch.equal(helpers.bits(row[c]), helpers.bits(want[c])) for c in ("tap_1", "tap_3"))


@pytest.mark.model
@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_export_on_a_full_disk_removes_its_partial_folder_and_says_what_it_needs(tmp_path, prenorm_run, reader_run, fmt):
    run = prenorm_run if fmt == "speculators" else reader_run
    with small_disk(tmp_path / "disk", "4m") as disk:  # a few samples fit
        out = disk / "export"
        full = capture_cli("export", str(run), str(out), "--format", fmt)
        assert full.returncode == 2 and "is full" in full.stderr and "the partial export was removed" in full.stderr
        assert "Traceback" not in full.stderr and "after 0 of" not in full.stderr, full.stderr
        assert len([line for line in full.stderr.splitlines() if "error" in line]) == 1  # beside the progress bar
        assert not out.exists()
        grow(disk, "256M")
        done = capture_cli("export", str(run), str(out), "--format", fmt, check=True)
        assert json.loads((out / "export.json").read_text())["samples"] == manifest.read(run).rows, done.stdout


def _train_args(run, target, *extra) -> list[str]:
    return ["drafter", "train", "--run", str(run), "--target-dir", str(target), "--steps", "4", "--anchors-per-step",
            "32", "--anchors-per-seq", "16", "--d-model", "32", "--eval-anchors", "128", "--checkpoint-every", "2",
            "--workers", "0", "--no-progress", *extra]


def _fill(folder) -> None:
    """Take every free byte of ``folder``'s file system."""
    with open(folder / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError:
            pass


def test_a_trainer_that_cannot_save_keeps_its_last_good_checkpoint_then_resumes(tmp_path):
    run, target = helpers.drafter_run(tmp_path / "r", 12, tokens=256, hidden=64, vocab=512)
    args = _train_args(run, target, "--heldout-fraction", "0.25")
    with small_disk(tmp_path / "disk", "640k") as disk:  # one checkpoint (~480 KB) fits, a second beside it does not
        out = disk / "d"
        full = capture_cli(*args, "--out", str(out))
        assert full.returncode == 2 and "Traceback" not in full.stderr
        assert "cannot write the checkpoint of step 4" in full.stderr and "the last good one is " in full.stderr
        assert "checkpoints/step-00000002: free space and rerun the same command" in full.stderr
        assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000002"
        assert not list((out / "checkpoints").glob(".*tmp"))
        grow(disk)
        again = capture_cli(*args, "--out", str(out), "--json", check=True)
        assert "from its checkpoint of step 2" in again.stderr and json.loads(again.stdout)["drafter"]["blocks"] > 0
        assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000004"


def test_a_follow_trainer_whose_ack_cannot_be_written_keeps_the_checkpoint_and_acks_on_the_rerun(tmp_path):
    from shards import live
    from shards.run import as_location

    held, target = helpers.drafter_run(tmp_path / "held", 6, tokens=256, hidden=64, vocab=512, dataset="held")
    with small_disk(tmp_path / "disk", "2m") as disk:
        run, _ = helpers.drafter_run(disk / "r", 12, tokens=256, hidden=64, vocab=512)
        _fill(disk)  # the run's disk: no room for an ack
        args = _train_args(run, target, "--follow", "--heldout-run", str(held), "--vocab-warmup", "2")
        out = tmp_path / "d"
        full = capture_cli(*args, "--out", str(out))
        assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr
        assert "the checkpoint of step 2 is saved but its ack" in full.stderr and "acks again" in full.stderr
        assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000002"
        assert not live.read(as_location(run), "tail")
        (disk / "filler").unlink()
        again = capture_cli(*args, "--out", str(out), "--json", check=True)
        assert "from its checkpoint of step 2" in again.stderr and json.loads(again.stdout)["drafter"]["blocks"] > 0
        latest = (out / "checkpoints" / "latest").read_text().strip()
        state = json.loads((out / "checkpoints" / latest / "state.json").read_text())
        assert state["step"] > 2
        assert live.read(as_location(run), "tail")[-1].position == state["streams"][0]["position"]


@pytest.mark.ray
@pytest.mark.model
def test_an_online_tee_on_a_full_disk_stops_cleanly_and_the_rerun_delivers_the_rest_once(tmp_path, sample_jsonl, ray_cluster):
    """`--keep` (the tee) on a 6 MiB disk: the capture stops at a commit boundary when a shard write meets
    ENOSPC, the trainer's stream ends with that one line; after the disk grows, the same trainer command
    gets exactly the rows it had not acked, and the shards hold every row once."""
    import os
    import sys
    import uuid

    from conftest import REPO, kill_tagged
    from shards.stream import ShardStream

    tag = uuid.uuid4().hex
    env = {**os.environ, "TQDM_DISABLE": "1", "CAPTURE_TEST_TAG": tag, **ray_cluster.env}  # the session's Ray
    with small_disk(tmp_path / "disk", "6m") as disk:
        out = disk / "online"
        cmd = [sys.executable, str(REPO / "tests" / "online_trainer.py"), "--out", str(out), "--dataset",
               str(sample_jsonl), "--limit", "16", "--keep", "--disk-reserve", "0", "--replicas", "1",  # the fault is the disk's
               "--ray-address", ray_cluster.address]
        try:
            first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            assert first.returncode == 1 and "stopped cleanly: the disk at" in first.stderr, first.stderr[-2000:]
            assert "is full" in first.stderr and "nothing half-written" in first.stderr
            before = [json.loads(x)["id"] for x in first.stdout.splitlines() if x.startswith('{"id"')]
            assert 0 < len(before) < 16 and verify(out).ok and not manifest.read(out).complete
            grow(disk)
            second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        finally:
            kill_tagged(tag)
        assert second.returncode == 0, second.stderr[-3000:]
        after = [json.loads(x)["id"] for x in second.stdout.splitlines() if x.startswith('{"id"')]
        assert not set(before) & set(after) and len(before) + len(after) == 16  # every row once to the trainer
        assert verify(out).ok and manifest.read(out).complete
        assert sorted(s["sample_id"] for s in ShardStream(out)) == sorted(set(before) | set(after))
