"""Runs on a file system without rename or append (issue 7): the object-store emulation
``objstore+file://`` (shards.run.NoRenameFS) and pyarrow over fsspec's in-memory file system.

The unit tests use small random rows (no model, seconds); the last test runs the real `capture run`
(SmolLM2) into the emulation, resumes it, and compares it with a local run of the same command.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pyarrow.fs as pafs
import pytest
import torch
from helpers import HEADER, make_header, make_rows, write_run

from common.errors import CaptureError
from conftest import capture_cli
from shards import manifest as manifest_mod
from shards import run as run_mod
from shards.format import schema
from shards.run import OBJSTORE_SCHEME, Location, resolve
from shards.manifest import ManifestWriter
from shards.run import MANIFEST_DIR
from shards.reader import iter_rows, read_table
from shards.stream import ShardStream
from shards.verify import verify
from shards.writer import ShardWriter
from shards.run import TMP_PREFIX


def memory_location() -> Location:
    """A fresh folder on pyarrow over fsspec's in-memory file system (no rename semantics involved)."""
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
    return Location(fs, f"/capture-test-{uuid.uuid4().hex}/run")


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_resolve():
    loc = resolve(f"{OBJSTORE_SCHEME}/tmp/x/run/")
    assert not loc.local and loc.path == "/tmp/x/run"
    assert resolve("rel/run") == Location(resolve("rel/run").filesystem, "rel/run") and resolve("rel/run").local
    assert resolve("file:///tmp/x").local and resolve("file:///tmp/x").path == "/tmp/x"
    with pytest.raises(CaptureError, match="absolute path"):
        resolve(f"{OBJSTORE_SCHEME}relative")
    with pytest.raises(CaptureError, match="cannot open nosuch://"):
        resolve("nosuch://bucket/run")


def test_emulation_refuses_rename_and_append_and_shows_objects_on_close(tmp_path):
    loc = resolve(f"{OBJSTORE_SCHEME}{tmp_path}/run")
    stream = loc.filesystem.open_output_stream(loc.join("a.bin"))
    stream.write(b"abc")
    assert not (tmp_path / "run" / "a.bin").exists()  # not visible before close
    stream.close()
    assert loc.read_bytes("a.bin") == b"abc" and loc.names() == ["a.bin"]
    with pytest.raises(OSError, match="no rename"):
        loc.filesystem.move(loc.join("a.bin"), loc.join("b.bin"))
    with pytest.raises(OSError, match="no append"):
        loc.filesystem.open_append_stream(loc.join("a.bin"))
    assert loc.names() == ["a.bin"]


def test_manifest_log_on_memory_fs():
    loc = memory_location()
    mw, m = ManifestWriter.open(loc, HEADER)
    assert mw.log.path is None and m.header is None  # entry objects, no appended file
    infos = write_run(loc, [make_rows(0, 3), make_rows(1, 2, start=3)], target_bytes=1, complete=False)
    mw, m = ManifestWriter.open(loc, HEADER)  # reopen: continues the numbering, no second header
    mw.complete({"reason": "test"})
    assert loc.names(MANIFEST_DIR) == ["0000000000-header.json", "0000000001-shard.json",
                                       "0000000002-shard.json", "0000000003-complete.json"]
    m = manifest_mod.read(loc)
    assert m.header == HEADER and m.complete
    assert [s["path"] for s in m.shards] == [i.path for i in infos]
    assert m.sample_ids() == {f"d:{i}" for i in range(5)}
    assert ShardStream(loc).order() == [s for shard in m.shards for s in shard["sample_ids"]]  # the training reader sees the same log
    # one entry per object, each a whole manifest line
    assert json.loads(loc.read_bytes(f"{MANIFEST_DIR}/0000000001-shard.json"))["path"] == infos[0].path
    with pytest.raises(CaptureError, match="different codec"):
        ManifestWriter.open(loc, make_header(codec="bf16-split"))
    mw.commit(write_run_shard(loc, 9))
    assert not manifest_mod.read(loc).complete
    loc.delete(f"{MANIFEST_DIR}/0000000002-shard.json")
    with pytest.raises(CaptureError, match="entry 2 is missing"):
        manifest_mod.read(loc)


def test_object_store_writes_never_rename(monkeypatch):
    """ShardWriter, manifest and provenance on an object store call no rename at all (the in-memory
    file system involves no os call, so any os.rename / os.replace would be ours)."""
    import os

    import provenance

    def refuse(*args):
        raise AssertionError(f"rename called: {args}")

    monkeypatch.setattr(os, "rename", refuse)
    monkeypatch.setattr(os, "replace", refuse)
    loc = memory_location()
    infos = write_run(loc, [make_rows(0, 4), make_rows(1, 4, start=4)], target_bytes=1)
    provenance.record.write(loc, {"x": 1})
    assert len(infos) == 2 and sorted(loc.names()) == sorted([i.path for i in infos] + ["provenance.json"])
    assert json.loads(loc.read_bytes("provenance.json")) == {"x": 1}
    assert verify(loc).ok


def write_run_shard(loc: Location, seed: int):
    writer = ShardWriter(loc, schema(HEADER), target_bytes=1 << 40)
    writer.write(make_rows(seed, 2, start=100 + 2 * seed))
    return writer.close()[0]


def test_object_store_shards_equal_local_ones_and_verify(tmp_path):
    uri = f"{OBJSTORE_SCHEME}{tmp_path}/obj"
    loc = resolve(uri)
    batches = [make_rows(0, 6), make_rows(1, 5, start=6)]
    obj = write_run(loc, batches, target_bytes=1)
    local = write_run(tmp_path / "local", batches, target_bytes=1)
    # same rows → byte-identical shards (hashes computed while streaming to the object store)
    assert [(i.rows, i.bytes, i.sha256) for i in obj] == [(i.rows, i.bytes, i.sha256) for i in local]
    files = all_files(tmp_path / "obj")
    assert not any(TMP_PREFIX in f for f in files) and "manifest.jsonl" not in files
    assert sorted(f for f in files if f.startswith(MANIFEST_DIR)) == [
        f"{MANIFEST_DIR}/000000000{k}-{kind}.json" for k, kind in enumerate(["header", "shard", "shard", "complete"])]
    report = verify(uri)
    assert report.ok and report.shards == 2 and report.rows == 11 and report.complete, report.problems
    assert capture_cli("shards", "verify", uri).returncode == 0
    t_obj = loc.read_table(obj[0].path)
    assert t_obj.equals(read_table(tmp_path / "local" / local[0].path))
    stat = json.loads(capture_cli("shards", "stat", uri, "--json", check=True).stdout)
    assert stat["rows"] == 11 and stat["shards"] == 2
    # a damaged object is found
    victim = tmp_path / "obj" / obj[1].path
    victim.write_bytes(victim.read_bytes()[:-1])
    report = verify(uri)
    assert not report.ok and any(obj[1].path in p and "size" in p for p in report.problems)


def test_abort_leaves_no_object(tmp_path):
    loc = resolve(f"{OBJSTORE_SCHEME}{tmp_path}/run")
    writer = ShardWriter(loc, schema(HEADER), target_bytes=1 << 40)
    writer.write(make_rows(0, 3))
    writer.abort()
    assert all_files(tmp_path) == [] and writer.close() == []


def test_gc_on_object_store(tmp_path):
    uri = f"{OBJSTORE_SCHEME}{tmp_path}/run"
    loc = resolve(uri)
    write_run(loc, [make_rows(0, 3)])
    orphan = write_run_shard(loc, 5)  # closed but never committed
    assert manifest_mod.garbage(loc) == [orphan.path]
    assert verify(uri).garbage == [orphan.path]
    loc.write_bytes(run_mod.LOCK, b"{}\n")  # a capture is writing
    r = capture_cli("shards", "gc", uri)
    assert r.returncode == 2 and "right now" in r.stderr
    loc.delete(run_mod.LOCK)
    r = capture_cli("shards", "gc", "--dry-run", uri, check=True)
    assert r.stdout.split() == ["would", "remove", orphan.path] and loc.exists(orphan.path)
    r = capture_cli("shards", "gc", uri, check=True)
    assert r.stdout.split() == ["removed", orphan.path] and not loc.exists(orphan.path)
    assert verify(uri).ok and verify(uri).garbage == []
    r = capture_cli("shards", "gc", f"{OBJSTORE_SCHEME}{tmp_path}/empty")
    assert r.returncode == 2 and "holds no capture run (manifest.d/ with a header)" in r.stderr


def test_capture_run_on_object_store_commits_resumes_and_matches_local(tmp_path, smol_dir, sample_jsonl):
    """The real pipeline (Ray replicas in their own processes, each writing through the run's Location
    on the NoRenameFS: any rename or append would fail the run) into the emulation, resumed, against a local run."""
    common = ["--dataset", str(sample_jsonl), "--layers", "3", "--max-tokens", "256", "--overlength", "truncate",
              "--shard-size", "1MiB", "--batch-tokens", "1", "--no-progress", "--json"]
    uri = f"{OBJSTORE_SCHEME}{tmp_path}/obj"
    loc = resolve(uri)
    s1 = json.loads(capture_cli("run", "--out", uri, "--limit", "4", *common, check=True).stdout)
    first = manifest_mod.read(loc).sample_ids()
    assert s1["committed_rows"] == len(first) > 0
    loc.write_bytes("shard-19700101T000000-000000000000.arrow", b"left by a killed replica")
    s2 = json.loads(capture_cli("run", "--out", uri, "--limit", "8", *common, check=True).stdout)
    local = tmp_path / "local"
    s3 = json.loads(capture_cli("run", "--out", str(local), "--limit", "8", *common, check=True).stdout)

    m = manifest_mod.read(loc)
    ids = [s for shard in m.shards for s in shard["sample_ids"]]
    assert len(ids) == len(set(ids))  # every sample once
    assert s2["already_committed"] == len(first) and s2["committed_rows"] == len(ids) - len(first)
    assert set(ids) - first and s2["total_rows"] == len(ids) == s3["committed_rows"]
    assert m.complete and len(m.completions) == 2
    files = all_files(tmp_path / "obj")
    assert not any(TMP_PREFIX in f for f in files)  # no temporary object, ever renamed or left
    assert run_mod.LOCK not in files and "manifest.jsonl" not in files
    assert manifest_mod.garbage(loc) == []  # the planted orphan was removed when the run completed
    kinds = [n.split("-", 1)[1] for n in loc.names(MANIFEST_DIR)]
    assert kinds[0] == "header.json" and kinds.count("complete.json") == 2
    prov = json.loads(loc.read_bytes("provenance.json"))
    assert [i["status"] for i in prov["invocations"]] == ["complete", "complete"]
    assert capture_cli("shards", "verify", uri).returncode == 0
    plan = json.loads(capture_cli("run", "--out", uri, "--limit", "8", "--dry-run", *common, check=True).stdout)
    assert plan["kept"] == 0 and plan["free_bytes"] is None  # everything committed; no disk to measure
    loc.write_bytes(run_mod.LOCK, b"{}\n")  # what a killed capture leaves
    r = capture_cli("run", "--out", uri, "--limit", "8", *common)
    assert r.returncode == 2 and f"delete {loc.join(run_mod.LOCK)} and rerun" in r.stderr

    # rows through the training reader (any pyarrow FileSystem) equal the local run's, bit for bit
    remote = {r["sample_id"]: r for r in ShardStream(Location(loc.filesystem, loc.path))}
    here = {r["sample_id"]: r for r in ShardStream(local)}
    assert remote.keys() == here.keys() == set(ids)
    for sid, row in here.items():
        assert torch.equal(remote[sid]["input_ids"], row["input_ids"])
        assert torch.equal(remote[sid]["loss_mask"], row["loss_mask"])
        assert torch.equal(remote[sid]["taps"], row["taps"])

    # the other commands take the URI too: audit, head (same answers as on the local run)
    audits = [json.loads(capture_cli("audit", run, "--reference", str(sample_jsonl), "--json", "--no-progress",
                                     check=True).stdout) for run in (uri, str(local))]
    assert audits[0]["categories"] == audits[1]["categories"] and audits[0]["categories"]["exact"]["rows"] > 0
    heads = [{h["sample_id"]: h for h in json.loads(capture_cli("shards", "head", run, "-n", "100", "--json",
                                                                  check=True).stdout)} for run in (uri, str(local))]
    assert heads[0] == heads[1] and set(heads[0]) == set(ids)  # commit order differs (two invocations), rows do not


def test_head_recode_export_on_object_store(tmp_path):
    """`shards head`, `shards recode` and `export` on an objstore+file:// run give what they give on a local run
    of the same rows (recode: object store to object store)."""
    batches = [make_rows(0, 4), make_rows(1, 3, start=4)]
    uri = f"{OBJSTORE_SCHEME}{tmp_path}/obj"
    write_run(resolve(uri), batches, target_bytes=1)
    write_run(tmp_path / "local", batches, target_bytes=1)
    heads = [json.loads(capture_cli("shards", "head", run, "-n", "5", "--json", check=True).stdout)
             for run in (uri, str(tmp_path / "local"))]
    assert heads[0] == heads[1] and [h["sample_id"] for h in heads[0]] == [f"d:{i}" for i in range(5)]

    fp8 = f"{OBJSTORE_SCHEME}{tmp_path}/fp8"
    r = capture_cli("shards", "recode", uri, fp8, "--codec", "fp8-e4m3", check=True)
    assert "recoded 7 rows" in r.stdout
    files = all_files(tmp_path / "fp8")
    assert not any(TMP_PREFIX in f for f in files) and run_mod.LOCK not in files
    assert verify(fp8).ok and manifest_mod.read(resolve(fp8)).header.codec == "fp8-e4m3"
    src, dst = (list(iter_rows(run)) for run in (uri, fp8))
    assert [(r["sample_id"], r["token_sha256"]) for r in dst] == [(r["sample_id"], r["token_sha256"]) for r in src]
    for a, b in zip(src, dst):
        assert (a["input_ids"] == b["input_ids"]).all() and (a["loss_mask"] == b["loss_mask"]).all()
        assert (a["argmax"] == b["argmax"]).all()

    capture_cli("export", uri, str(tmp_path / "x-obj"), "--format", "specforge", "--no-progress", check=True)
    capture_cli("export", str(tmp_path / "local"), str(tmp_path / "x-local"), "--format", "specforge",
                "--no-progress", check=True)
    for i in range(7):
        a = torch.load(tmp_path / "x-obj" / "rows_0-2000" / f"data_{i}.ckpt")
        b = torch.load(tmp_path / "x-local" / "rows_0-2000" / f"data_{i}.ckpt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
