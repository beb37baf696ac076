"""`capture drafter train --online`: training while the capture runs, on real Ray replicas of SmolLM2 (a file of
its own, so that pytest-xdist runs it beside the offline drafter tests)."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from drafter import data
from drafter.train import evaluate_checkpoint
from shards.reader import iter_rows
from test_drafter import _jsonl, _kill_after_a_checkpoint, small_run  # noqa: F401 - small_run is a fixture


@pytest.mark.ray
def test_online_training_steps_while_the_capture_runs_and_resumes_after_a_kill(small_run, tmp_path, ray_cluster):
    """`drafter train --online`: the same capture settings as small_run streamed from Ray replicas with no
    shards, trained on as units arrive. SIGKILLed (its capture dies with it) after a checkpoint, the same
    command resumes from it: the restarted capture delivers only rows not acked, the first step comes before
    the capture ends, every train row is trained on once and acked, no held-out row is trained on, and the
    waits are reported."""
    from shards import live
    from shards.run import as_location

    config = tmp_path / "capture.yaml"
    config.write_text(yaml.safe_dump({
        "target": "smollm2-135m", "dataset": "sharegpt", "limit": 24, "layers": "3,15,27", "max_tokens": 256,
        "overlength": "truncate", "unit_tokens": 512, "ray_address": ray_cluster.address, "out": str(tmp_path / "live")}))
    out = tmp_path / "a"
    args = ["drafter", "train", "--online", str(config), "--out", str(out), "--steps", "1000", "--anchors-per-step",
            "32", "--anchors-per-seq", "16", "--heldout-fraction", "0.25", "--eval-anchors", "512", "--d-model", "64",
            "--vocab-warmup", "2", "--checkpoint-every", "2", "--workers", "0", "--no-progress",
            "--target-dir", json.loads((small_run / "provenance.json").read_text())["model_dir"]]
    env = {**os.environ, "TQDM_DISABLE": "1", **ray_cluster.env}
    at = _kill_after_a_checkpoint(args, out, env)["step"]
    acked_before = live.acked_ids(as_location(tmp_path / "live"))
    assert len(acked_before) <= 2 * at  # each checkpoint acks the 2 rows a step it covers, after it is written
    again = subprocess.run([sys.executable, "-m", "cli", *args, "--json"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads(again.stdout)
    assert not list((tmp_path / "live").glob("*.arrow"))  # nothing but the run's log on disk
    assert result["first_step_s"] < result["capture_s"]
    assert result["trainer_waited_s"] > 0 and result["capture_waited_s"] >= 0
    trained = [sid for e in _jsonl(out / "samples.jsonl") for _, _, sid in e["samples"]]
    rows = {r["sample_id"] for r in iter_rows(small_run)}
    held = {sid for sid in rows if data.heldout(sid, 0.25)}
    assert len(trained) == len(set(trained)) and not set(trained) & held and set(trained) >= acked_before
    assert len(trained) == result["data"]["train"]["conversations"] >= len(rows - held) - 2  # per_step 2: one may be left
    assert live.acked_ids(as_location(tmp_path / "live")) == set(trained)
    assert result["data"]["heldout"]["conversations"] + result["data"]["overlap_removed"] == len(held)
    assert result["drafter"]["blocks"] == result["untrained"]["blocks"] == result["lookup"]["blocks"] > 0
    score = evaluate_checkpoint(out, str(small_run))
    assert score["conversations"] + score["skipped_trained_on"] == len(held) and score["conversations"]
