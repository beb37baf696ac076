"""`capture run` end to end, as a user runs it: real SmolLM2, real ShareGPT rows, local Ray."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from conftest import REPO, capture_cli, capture_process
from shards import manifest
from shards.reader import iter_rows

SMALL = ["--max-tokens", "256", "--overlength", "truncate", "--no-progress"]


def summary_of(proc) -> dict:
    return json.loads(proc.stdout)


def committed(run_dir) -> list[str]:
    return [s for shard in manifest.read(run_dir).shards for s in shard["sample_ids"]]


@pytest.mark.model
def test_run_matches_reference_resumes_and_extends(tmp_path, smol_dir):
    out = tmp_path / "run"
    args = ["run", "--out", str(out), "--dataset", "sharegpt", "--layers", "3,15,29", "--final", "post-norm",
            "--limit", "10", "--shard-size", "128KiB", "--batch-tokens", "1", "--dtype", "bfloat16", "--json", *SMALL]
    threads = set(threading.enumerate())  # an earlier test's objects may hold threads of their own
    s = summary_of(capture_cli(*args, check=True))
    assert s["rows_read"] == 10
    assert s["executor"] == "local"  # auto: one hf replica runs in the driver's process, no Ray
    assert s["kept"] + sum(s["skipped"].values()) == 10
    assert s["committed_rows"] == s["kept"] == s["total_rows"] > 0
    # the in-process replica is released: no writer, encoder or replica thread outlives the run (each held the model)
    assert not [t.name for t in set(threading.enumerate()) - threads
                if t.name.startswith(("shard-writer", "encode", "replica"))]
    assert capture_cli("shards", "verify", str(out)).returncode == 0
    m = manifest.read(out)
    assert m.complete and list(m.header.columns) == ["tap_3", "tap_15", "tap_29", "final"]

    # Every tap, the final state and argmax against a plain HF forward of the stored ids.
    # --batch-tokens 1 gives every record a forward of its own and --dtype bfloat16 the reference's arithmetic
    # (auto computes in float32 on a CPU without native bf16), so states are bit-exact.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.bfloat16).eval()
    rows = list(iter_rows(out))
    assert len(rows) == s["committed_rows"]
    for row in rows[:4]:
        ids = torch.from_numpy(row["input_ids"].astype(np.int64))[None]
        with torch.inference_mode():
            ref = model(ids, output_hidden_states=True)
        for k in (3, 15):
            assert torch.equal(row[f"tap_{k}"], ref.hidden_states[k + 1][0])
        assert torch.equal(model.model.norm(row["tap_29"][None])[0], ref.hidden_states[30][0])
        assert torch.equal(row["final"], ref.hidden_states[30][0])
        np.testing.assert_array_equal(row["argmax"], ref.logits[0].argmax(-1).numpy())
        assert row["num_tokens"] == len(row["input_ids"]) <= 256

    # Rerun: nothing redone, committed shards untouched.
    before = [(sh["path"], sh["sha256"]) for sh in m.shards]
    again = summary_of(capture_cli(*args, check=True))
    assert again["committed_rows"] == 0 and again["already_committed"] == s["committed_rows"]
    assert [(sh["path"], sh["sha256"]) for sh in manifest.read(out).shards] == before

    # A larger --limit extends the finished run with new rows only.
    more = summary_of(capture_cli(*[a if a != "10" else "14" for a in args], check=True))
    assert more["rows_read"] == 14 and more["already_committed"] == s["committed_rows"]
    ids = committed(out)
    assert len(ids) == len(set(ids)) == s["committed_rows"] + more["committed_rows"]
    assert {f"sharegpt:{i}" for i in range(14)} >= set(ids)
    assert capture_cli("shards", "verify", str(out)).returncode == 0

    # Another target, taps or template against this run folder is refused, with the differing fields.
    other = capture_cli("run", "--out", str(out), "--layers", "3,15", "--limit", "2", *SMALL)
    assert other.returncode == 2
    assert "different taps" in other.stderr and "Traceback" not in other.stderr


@pytest.mark.model
@pytest.mark.ray
def test_ray_and_in_process_replicas_write_identical_shards(tmp_path, ray_cluster):
    """--executor ray (a Ray actor on the session's cluster) and local (the driver's process) commit
    byte-identical shards."""
    runs = {}
    for executor in ("ray", "local"):
        out = tmp_path / executor
        args = ("run", "--out", str(out), "--limit", "5", "--executor", executor, "--json", *SMALL)
        if executor == "ray":  # a Ray driver in a process of its own
            s = summary_of(capture_process(*args, "--ray-address", ray_cluster.address, env=ray_cluster.env,
                                           check=True))
        else:
            s = summary_of(capture_cli(*args, check=True))
        assert s["executor"] == executor and s["committed_rows"] > 0
        runs[executor] = [(sh["sample_ids"], sh["rows"], sh["sha256"]) for sh in manifest.read(out).shards]
    assert runs["ray"] == runs["local"] and runs["local"]


@pytest.mark.model
def test_sigkill_mid_run_then_rerun_is_exactly_once(tmp_path):
    out = tmp_path / "run"
    args = ["run", "--out", str(out), "--limit", "40", "--shard-size", "32KiB", "--unit-tokens", "512", *SMALL]
    proc = subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(manifest.read(out).shards if out.exists() else []) < 2:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and every Ray process it started
    proc.wait()
    killed = manifest.read(out)
    assert not killed.complete and len(killed.shards) >= 2
    before = {sh["path"]: sh["sha256"] for sh in killed.shards}

    s = summary_of(capture_cli(*args, "--json", check=True))
    assert s["rows_read"] == 40
    ids = committed(out)
    assert len(ids) == len(set(ids)), "a sample was committed twice"
    # Exactly the records a fresh plan keeps: nothing lost, nothing extra.
    plan = summary_of(capture_cli("run", "--out", str(tmp_path / "fresh"), "--limit", "40", "--dry-run", "--json", *SMALL,
                                  check=True))
    assert len(ids) == plan["kept"] and s["already_committed"] == sum(sh["rows"] for sh in killed.shards)
    after = {sh["path"]: sh["sha256"] for sh in manifest.read(out).shards}
    assert all(after[p] == sha for p, sha in before.items())
    from common.hashing import sha256_file

    assert all(sha256_file(out / p) == sha for p, sha in before.items())
    assert manifest.read(out).complete
    assert capture_cli("shards", "verify", str(out)).returncode == 0
    assert not (tmp_path / "fresh").exists()  # a dry run writes nothing


@pytest.mark.model
def test_disk_full_stops_cleanly_then_resumes(tmp_path):
    """A real 8 MiB disk (the run needs ~20 MiB): the run stops at a commit boundary, committed shards verify, nothing is
    half-written; after the disk grows, rerunning completes with every record exactly once."""
    from conftest import small_disk

    with small_disk(tmp_path / "disk", "8M") as disk:
        out = disk / "run"
        args = ["run", "--out", str(out), "--limit", "40", "--shard-size", "256KiB", "--unit-tokens", "512",
                "--disk-reserve", "0", *SMALL]
        proc = capture_cli(*args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "stopped cleanly" in proc.stderr and "Traceback" not in proc.stderr
        first = manifest.read(out)
        assert first.shards and not first.complete
        assert capture_cli("shards", "verify", str(out)).returncode == 0
        assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
        before = {sh["path"]: sh["sha256"] for sh in first.shards}

        subprocess.run(["mount", "-o", "remount,size=64M", str(disk)], check=True)
        s = summary_of(capture_cli(*args, "--json", check=True))
        assert s["already_committed"] == sum(sh["rows"] for sh in first.shards)
        ids = committed(out)
        assert len(ids) == len(set(ids)) == s["total_rows"]
        assert {sh["path"]: sh["sha256"] for sh in manifest.read(out).shards if sh["path"] in before} == before
        assert manifest.read(out).complete
        assert capture_cli("shards", "verify", str(out)).returncode == 0


@pytest.mark.model
def test_dtype_is_recorded_and_kept_on_resume(tmp_path):
    """``--dtype float32``: the header says the hf engine computed in float32 (states stored in bf16); a resume
    with ``--dtype auto`` keeps the run's arithmetic whatever this CPU would pick, another ``--dtype`` is refused
    (the vllm engine's ``--dtype``: tests/test_vllm.py)."""
    from conftest import capture_inproc

    out = tmp_path / "run"
    args = ["run", "--out", str(out), "--limit", "3", "--json", *SMALL]
    s = summary_of(capture_cli(*args, "--dtype", "float32", check=True))
    head = manifest.read(out).header
    assert head.engine == {"name": "hf", "compute_dtype": "float32"} and head.dtype == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for row in iter_rows(out) for k, t in row.items() if k.startswith("tap_"))
    more = capture_cli(*[a if a != "3" else "5" for a in args], check=True)
    assert summary_of(more)["already_committed"] == s["committed_rows"] and summary_of(more)["committed_rows"] > 0
    from capture.engines import compute_dtype

    # said when this CPU's auto would have picked another dtype (bf16 where it computes bf16 natively)
    assert ("resuming in the run's own compute dtype float32" in more.stderr) == (compute_dtype("auto", "bfloat16") != "float32")
    assert summary_of(more)["engine"].startswith("hf, computing in float32 (")  # the run's, whatever auto picks here
    assert manifest.read(out).header.engine == head.engine
    other = capture_inproc(*args, "--dtype", "bfloat16")
    assert other.exit_code == 2 and "was computed in float32; --dtype bfloat16 would mix two arithmetics" in other.stderr


@pytest.mark.model
def test_a_run_that_committed_nothing_starts_again_with_new_settings(tmp_path, reader_run):
    """A header-only folder (an engine that failed to start after the header was written) is no run to
    protect: another codec (or engine) starts it afresh, with a warning; once a row is committed the same
    change is refused."""
    out = tmp_path / "run"
    old = manifest.read(reader_run).header
    manifest.ManifestWriter.open(out, old.replace(codec="fp8-e4m3"))
    args = ["run", "--out", str(out), "--dataset", "sharegpt", "--layers", "3,15,27", "--final", "post-norm",
            "--limit", "2", "--json", *SMALL]
    proc = capture_cli(*args, check=True)
    assert "holds no rows yet" in proc.stderr and "codec" in proc.stderr
    m = manifest.read(out)
    assert m.header.codec == "bf16-split" and m.rows == summary_of(proc)["total_rows"] > 0
    refused = capture_cli(*args, "--codec", "fp8-e4m3")
    assert refused.returncode == 2 and "different codec" in refused.stderr


@pytest.mark.model
def test_a_resumed_run_keeps_the_cell_layout_of_its_format_version(tmp_path, reader_run):
    """A run started by format 1.4 (header written, as a 1.4 capture leaves it) and resumed by this one
    writes 1.4 shards: int4-b32 codes one a byte, the schema's version 1.4, cells that decode within bound."""
    import zstandard

    from shards.format import read_header
    from shards.reader import read_table, shard_paths
    from shards.rows import read_row

    out = tmp_path / "run"
    old = manifest.read(reader_run).header
    manifest.ManifestWriter.open(out, old.replace(codec="int4-b32", format_version="1.4"))
    args = ["run", "--out", str(out), "--dataset", "sharegpt", "--layers", "3,15,27", "--final", "post-norm",
            "--codec", "int4-b32", "--limit", "2", "--json", *SMALL]
    capture_cli(*args, check=True)
    assert manifest.read(out).header.format_version == "1.4"
    table = read_table(shard_paths(out)[0])
    assert read_header(table.schema).format_version == "1.4"
    tokens = table.column("num_tokens")[0].as_py()
    nb = -(-old.hidden_size // 32)
    cell = table.column("tap_3")[0].as_py()
    assert zstandard.frame_content_size(cell[:-8]) == 2 * tokens * nb + 32 * tokens * nb  # one code a byte
    assert read_row(table, 0).states["tap_3"].shape == (tokens, old.hidden_size)


def test_eta_counts_the_records_the_engine_has_left():
    from capture.driver import _eta

    # all 40 rows read (20 kept), 5 records through the engine in 10 s: 15 more take 30 s
    assert _eta(10.0, 5, 20, 40, 40) == "00:00:30"
    # half the rows read, half of them kept: 20 records expected, 15 left
    assert _eta(10.0, 5, 10, 20, 40) == "00:00:30"
    assert _eta(10.0, 0, 10, 20, 40) is None and _eta(10.0, 5, 10, 20, None) is None
