"""Findings of a fresh user's break attempts (issue 14, point 6), each a one-line error or a correct
result now: an object-store run extended through its local path, a manifest holding bytes that are no
text, a run path under a file, a dry run on an object store, an export / drafter folder that cannot be
made, a drafter trained into a capture run, an empty Hugging Face split. Small random runs
(tests/helpers.py), no model, except the dry run (the real tokenizer)."""

from __future__ import annotations

import shutil

import pytest
from helpers import make_rows, write_run

from common.errors import CaptureError
from conftest import capture_cli, capture_inproc
from shards import manifest as manifest_mod
from shards.run import MANIFEST, MANIFEST_DIR, OBJSTORE_SCHEME, resolve
from shards.verify import verify


def test_an_object_store_run_is_not_extended_through_its_local_path(tmp_path):
    write_run(resolve(f"{OBJSTORE_SCHEME}{tmp_path}/obj"), [make_rows(0, 3)])
    local = tmp_path / "copy"
    shutil.copytree(tmp_path / "obj", local)  # e.g. `aws s3 sync` of the run
    before = sorted(p.name for p in (local / MANIFEST_DIR).iterdir())
    with pytest.raises(CaptureError, match=r"keeps its manifest in manifest.d/ .* extend it as objstore\+file://"):
        write_run(local, [make_rows(1, 2, start=3)])
    assert not (local / MANIFEST).exists() and sorted(p.name for p in (local / MANIFEST_DIR).iterdir()) == before
    assert manifest_mod.read(local).rows == 3  # still read through manifest.d/


def test_a_manifest_with_bytes_that_are_no_text_is_reported_damaged(good_run):
    run, _, _ = good_run
    lines = (run / MANIFEST).read_bytes().splitlines(keepends=True)
    (run / MANIFEST).write_bytes(lines[0] + b"\xff\xfe\x00\x00\n" + b"".join(lines[1:]))
    with pytest.raises(CaptureError, match="line 2 is not valid JSON; the manifest is damaged"):
        manifest_mod.read(run)
    r = capture_cli("shards", "verify", str(run))  # a damage report, not a crash
    assert r.returncode == 1 and "line 2 is not valid JSON; the manifest is damaged" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr


def test_a_run_path_under_a_file_is_one_line(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    with pytest.raises(CaptureError, match="is not a folder"):
        manifest_mod.read(afile / "run")
    res = capture_inproc("drafter", "train", "--run", str(afile / "run"), "--out", str(tmp_path / "d"))
    assert res.exit_code == 2 and "is not a folder (it, or a folder above it, is a file)" in res.output


def test_export_and_drafter_folders_that_cannot_be_made_or_hold_a_run(good_run, tmp_path):
    run, _, _ = good_run
    afile = tmp_path / "f"
    afile.write_text("x")
    res = capture_inproc("export", str(run), str(afile / "out"), "--format", "speculators")
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1].startswith("error:"), res.output
    res = capture_inproc("drafter", "train", "--run", str(run), "--out", str(run), "--target-dir", str(tmp_path))
    assert res.exit_code == 2 and "holds a capture run; train into another --out" in res.output
    assert verify(str(run)).ok  # nothing written into the run


def test_dry_run_on_an_object_store_prints_its_plan(tmp_path, smol_dir, sample_jsonl):
    r = capture_cli("run", "--target", "smollm2-135m", "--dataset", str(sample_jsonl), "--limit", "2", "--dry-run",
                    "--out", f"{OBJSTORE_SCHEME}{tmp_path}/os", check=True)
    assert r.stdout.startswith(f"plan for {OBJSTORE_SCHEME}{tmp_path}/os: ") and "GiB free" not in r.stdout


def test_dry_run_refuses_what_the_run_refuses(tmp_path, smol_dir, sample_jsonl):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    r = capture_cli("run", "--target", "smollm2-135m", "--dataset", str(sample_jsonl), "--limit", "2", "--dry-run",
                    "--out", str(busy))
    assert r.returncode == 2 and "is not empty and holds no capture run" in r.stderr
    assert (busy / "notes.txt").read_text() == "mine"


def test_hf_dataset_of_an_empty_split_has_no_rows(good_run):
    from shards.hf import hf_dataset

    run, _, rows = good_run
    ds = hf_dataset(run, split="heldout", heldout_fraction=1e-9)
    assert len(ds) == 0 and "input_ids" in ds.column_names


def test_a_flipped_byte_in_a_state_cell_fails_to_decode(good_run):
    """A damaged cell is an error naming column and row, not silently other states: zstd frames carry their
    content checksum (XXH64), and since format 1.3 every cell ends with its own checksum (XXH3-64 from 1.4),
    which covers the bytes outside any frame too (bf16-split's raw low bytes: flipped here in a bf16-split table)."""
    import pyarrow as pa

    from shards.format import STATE_TYPE, FormatError
    from shards.reader import read_table
    from shards.rows import state_columns, state_tensor

    run, infos, _ = good_run
    table = read_table(run / infos[0].path)  # codec bf16: the whole cell is one zstd frame
    col = state_columns(table)[0]
    good = state_tensor(table, col, 0)
    cells = table.column(col).to_pylist()
    damaged = bytearray(cells[0])
    damaged[len(damaged) // 2] ^= 0x10
    i = table.schema.get_field_index(col)
    bad = table.set_column(i, table.schema.field(i), pa.array([bytes(damaged)] + cells[1:], type=STATE_TYPE))
    with pytest.raises(FormatError, match=rf"{col} of row 0 does not decode .* the shard is damaged"):
        state_tensor(bad, col, 0)
    assert state_tensor(bad, col, 1).equal(state_tensor(table, col, 1)) and good.shape[0] > 0

    from helpers import make_header

    from shards.format import schema
    from shards.rows import record_batch

    split = pa.Table.from_batches([record_batch(schema(make_header(codec="bf16-split")), make_rows(2, 5))])
    col = state_columns(split)[0]
    cells = split.column(col).to_pylist()
    damaged = bytearray(cells[0])
    damaged[-12] ^= 0x01  # a raw low byte (before the 8 checksum bytes): one mantissa bit of one value
    i = split.schema.get_field_index(col)
    bad = split.set_column(i, split.schema.field(i), pa.array([bytes(damaged)] + cells[1:], type=STATE_TYPE))
    with pytest.raises(FormatError, match=rf"{col} of row 0 does not decode .*fails its xxh3_64.* the shard is damaged"):
        state_tensor(bad, col, 0)


def test_a_resume_refuses_a_run_whose_committed_shard_is_gone(prenorm_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(prenorm_run, run)
    victim = manifest_mod.read(run).shards[0]["path"]
    (run / victim).unlink()
    before = (run / MANIFEST).read_bytes()
    res = capture_inproc("run", "--target", "smollm2-135m", "--dataset", "sharegpt", "--layers", "3,15,27", "--final",
                         "pre-norm", "--limit", "16", "--max-tokens", "256", "--overlength", "truncate", "--out",
                         str(run), "--no-progress")
    assert res.exit_code == 2 and f"committed shard(s) are missing or of another size ({victim})" in res.output, res.output
    assert (run / MANIFEST).read_bytes() == before


def test_recode_refuses_a_foreign_folder_and_head_a_negative_count(good_run, tmp_path):
    run, _, _ = good_run
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    res = capture_inproc("shards", "recode", str(run), str(busy), "--codec", "fp8-e4m3")
    assert res.exit_code == 2 and "is not empty and holds no capture run" in res.output, res.output
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    res = capture_inproc("shards", "recode", str(run), str(tmp_path / "new"), "--codec", "fp8-e4m3")
    assert res.exit_code == 0 and verify(str(tmp_path / "new")).ok, res.output
    res = capture_inproc("shards", "head", str(run), "-n", "-1")
    assert res.exit_code == 2 and "-1 is not in the range x>=1" in res.output


def _crafted(tmp_path, change, copy: bool = False) -> tuple:
    """A run ``victim`` of 4 rows and a run ``crafted`` whose manifest is the victim's with its shard line
    passed through ``change`` (and, ``copy``, the victim's shard file); returns both folders."""
    import json

    victim = tmp_path / "victim"
    write_run(victim, [make_rows(0, 4)])
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    for shard in victim.glob("*.arrow") if copy else ():
        shutil.copy(shard, crafted)
    lines = [json.loads(x) for x in (victim / MANIFEST).read_text().splitlines()]
    lines = [change(x) if x["kind"] == "shard" else x for x in lines]
    (crafted / MANIFEST).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return victim, crafted


@pytest.mark.parametrize("path", ["../victim/{}", "/abs/{}", "sub/{}", "..", "a\\b"])
def test_a_manifest_naming_a_file_outside_the_run_is_refused_in_one_line_by_every_reader(tmp_path, path):
    from shards.reader import iter_rows
    from shards.stream import ShardStream

    victim, crafted = _crafted(tmp_path, lambda x: {**x, "path": path.format(x["path"])})
    before = sorted(p.name for p in victim.iterdir())
    wanted = "is not a plain file name inside the run; the manifest is damaged or crafted"
    for cmd in (["verify"], ["ls"], ["stat"], ["head"], ["gc"], ["recode", str(tmp_path / "copy"), "--codec", "bf16"]):
        r = capture_cli("shards", *cmd[:1], str(crafted), *cmd[1:])
        assert r.returncode in (1, 2) and wanted in r.stderr + r.stdout, (cmd, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, cmd
        if cmd == ["verify"]:
            assert "run state unknown (its manifest cannot be read)" in r.stdout  # not "no completion record"
    for read in (lambda: next(iter(ShardStream(crafted))), lambda: next(iter_rows(crafted)),
                 lambda: manifest_mod.read(crafted)):
        with pytest.raises(CaptureError, match=wanted):
            read()
    assert sorted(p.name for p in victim.iterdir()) == before  # nothing opened for writing, nothing deleted


def test_removed_paths_and_ack_names_outside_the_run_are_refused(tmp_path):
    import json

    from shards import live

    victim, _ = _crafted(tmp_path, lambda x: x)
    with open(victim / MANIFEST, "a") as f:  # a retention record naming a file elsewhere
        f.write(json.dumps({"kind": "removed", "paths": ["../other/shard-x.arrow"], "reason": "retain"}) + "\n")
    with pytest.raises(CaptureError, match=r"line 4: removed paths .* are not plain file names inside the run"):
        manifest_mod.read(victim)
    shard = json.loads((victim / MANIFEST).read_text().splitlines()[1])["path"]
    ack = {"kind": "tail", "rank": 0, "world_size": 1, "time": 1.0, "shards": [shard, "../other/shard-x.arrow"],
           "sample_ids": [], "epoch": 0, "position": 4}
    (victim / "ack-00000-0000000000000001.json").write_text(json.dumps(ack))
    assert live.read(resolve(str(victim)), "tail") == []  # ignored with a warning, so retention removes nothing
    ack["shards"] = [shard]
    (victim / "ack-00000-0000000000000001.json").write_text(json.dumps(ack))
    assert [a.shards for a in live.read(resolve(str(victim)), "tail")] == [(shard,)]


def test_a_manifest_whose_counts_disagree_with_its_shard_is_one_line(tmp_path):
    from shards.reader import iter_rows
    from shards.stream import ShardStream

    def five_rows(x):  # the line claims a fifth row the file does not hold
        return {**x, "rows": 5, "sample_ids": x["sample_ids"] + ["t:99"], "token_sha256": x["token_sha256"] + ["0" * 64]}

    _, crafted = _crafted(tmp_path, five_rows, copy=True)
    stream = iter(ShardStream(crafted))
    assert [next(stream)["sample_id"] for _ in range(4)] == manifest_mod.read(crafted).shards[0]["sample_ids"][:4]
    with pytest.raises(CaptureError, match=r"row 4 of shard-\S+ is not t:99, as the manifest records; the run is damaged"):
        next(stream)
    with pytest.raises(CaptureError, match=r"holds 4 rows where the manifest records 5"):
        list(iter_rows(crafted))
    r = capture_cli("shards", "verify", str(crafted))
    assert r.returncode == 1 and "4 rows != manifest 5" in r.stdout + r.stderr

    _, crafted = _crafted(tmp_path / "b", lambda x: {**x, "rows": 7})
    with pytest.raises(CaptureError, match=r"records rows 7, 4 sample ids, 4 token hashes \(counts must be"):
        manifest_mod.read(crafted)
    _, crafted = _crafted(tmp_path / "c", lambda x: {**x, "tokens": "many"})
    r = capture_cli("shards", "stat", str(crafted))
    assert r.returncode == 2 and "counts must be non-negative integers that agree" in r.stderr
