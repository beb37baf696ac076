"""shards.verify and `capture shards verify` / `capture shards gc`: a good run passes; flipped bytes,
truncation, missing shards, edited manifest lines, duplicate ids, foreign headers, inconsistent rows,
bad finish_reasons and unreadable versions are reported; uncommitted files are garbage, which gc
removes exactly (and refuses on a live run or a folder without a run).

No model: the fixture ``good_run`` (conftest.py) is three shards of three random rows. Fast.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import (BIG, HEADER, REGENERATED, SCHEMA, flip_byte, hand_written_shard, invoke, make_header,
                     make_row, make_rows, manifest_lines, rewrite_manifest, write_run)

import cli
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards.manifest import ManifestWriter
from shards.run import MANIFEST
from shards.manifest import garbage as garbage_of
from shards.verify import verify
from shards.writer import ShardInfo, ShardWriter
from shards.rows import Row
from shards.run import TMP_PREFIX


def test_verify_ok_on_good_run(good_run):
    run, infos, rows = good_run
    report = verify(run)
    assert report.ok, report.problems
    assert report.problems == [] and report.garbage == []
    assert report.shards == 3
    assert report.rows == 9
    assert report.tokens == sum(len(r.input_ids) for r in rows)
    assert report.complete is True


def _only_problem_for(report, name: str) -> str:
    assert not report.ok
    assert report.problems, "expected a problem"
    for p in report.problems:
        assert p.startswith(f"{name}: "), report.problems
    return " | ".join(report.problems)


def test_verify_flipped_byte(good_run):
    run, infos, _ = good_run
    flip_byte(run / infos[1].path)
    text = _only_problem_for(verify(run), infos[1].path)
    assert "sha256" in text and infos[1].sha256[:16] in text


def test_verify_flipped_last_byte(good_run):
    run, infos, _ = good_run
    path = run / infos[0].path
    flip_byte(path, path.stat().st_size - 1)
    assert "sha256" in _only_problem_for(verify(run), infos[0].path)


def test_verify_truncated(good_run):
    run, infos, _ = good_run
    path = run / infos[2].path
    with open(path, "r+b") as f:
        f.truncate(infos[2].bytes // 2)
    text = _only_problem_for(verify(run), infos[2].path)
    assert f"size {infos[2].bytes // 2} != manifest {infos[2].bytes}" in text


def test_verify_missing(good_run):
    run, infos, _ = good_run
    (run / infos[0].path).unlink()
    report = verify(run)
    assert report.problems == [f"{infos[0].path}: missing"]
    assert report.shards == 3


def _add_row(e):  # a row the shard file does not hold, the line itself consistent (rows = ids = hashes)
    e["rows"] += 1
    e["sample_ids"].append("d:998")
    e["token_sha256"].append("0" * 64)


def _rename_sample(e):
    e["sample_ids"][1] = "d:999"


def _add_tokens(e):
    e["tokens"] += 5


@pytest.mark.parametrize("shard, edit, expected", [
    (1, _add_row, lambda info: "3 rows != manifest 4"),
    (2, _rename_sample, lambda info: "sample ids differ"),
    (0, _add_tokens, lambda info: f"!= manifest {info.tokens + 5}/{info.loss_tokens}"),
])
def test_verify_manifest_line_edited(good_run, shard, edit, expected):
    run, infos, _ = good_run
    lines = manifest_lines(run)
    edit(next(e for e in lines if e.get("path") == infos[shard].path))
    rewrite_manifest(run, lines)
    text = _only_problem_for(verify(run), infos[shard].path)
    assert expected(infos[shard]) in text


def test_verify_duplicate_sample_id_across_shards(good_run):
    run, infos, rows = good_run
    rng = np.random.default_rng(8)
    dup = make_row(rng, 4, 10)  # d:4 is already in the second shard
    fresh = make_row(rng, 100, 12)
    mw, _ = ManifestWriter.open(run, HEADER)
    w = ShardWriter(run, SCHEMA, target_bytes=BIG)
    w.write([fresh, dup])
    [info] = w.close()
    mw.commit(info)
    report = verify(run)
    assert report.problems == [f"{info.path}: 1 sample id(s) already committed, e.g. d:4"]
    assert report.rows == 11


def test_verify_schema_header_differs(good_run):
    """A shard written with another run's header (but committed with the right sha) is reported."""
    run, infos, _ = good_run
    other = make_header(tokenizer_sha256="c" * 64)
    w = ShardWriter(run, shard_format.schema(other), target_bytes=BIG)
    w.write(make_rows(9, 2, start=50))
    [info] = w.close()
    mw, _ = ManifestWriter.open(run, HEADER)
    mw.commit(info)
    report = verify(run)
    assert report.problems == [f"{info.path}: schema header differs from the manifest in tokenizer_sha256"]


def _commit_bad_rows(run: Path, rows: list[Row]) -> ShardInfo:
    """Write ``rows`` (which the writer does not validate) as a correctly committed shard."""
    w = ShardWriter(run, SCHEMA, target_bytes=BIG)
    w.write(rows)
    [info] = w.close()
    mw, _ = ManifestWriter.open(run, HEADER)
    mw.commit(info)
    return info


@pytest.mark.parametrize("damage, message", [
    ("state_shape", "tap_3: 1 row(s) do not decode to [T, H], e.g. d:601"),
    ("token_hash", "token_sha256 mismatch in 1 row(s), e.g. d:601"),
    ("mask_length", "loss_mask lengths differ from num_tokens in 1 row(s)"),
    ("argmax_length", "argmax lengths differ from num_tokens in 1 row(s)"),
])
def test_verify_row_self_consistency(good_run, damage, message):
    run, infos, _ = good_run
    rows = make_rows(19, 3, start=600)
    r = rows[1]
    if damage == "state_shape":
        rows[1] = dataclasses.replace(r, states={**r.states, "tap_3": r.states["tap_3"][:-1]})
    elif damage == "token_hash":
        rows[1] = dataclasses.replace(r, token_sha256="0" * 64)
    elif damage == "mask_length":
        rows[1] = dataclasses.replace(r, loss_mask=np.append(r.loss_mask, True))
    else:
        rows[1] = dataclasses.replace(r, argmax=r.argmax[:-1])
    info = _commit_bad_rows(run, rows)
    report = verify(run)
    assert f"{info.path}: {message}" in report.problems, report.problems
    assert all(p.startswith(info.path) for p in report.problems)


def test_verify_without_manifest(tmp_path):
    report = verify(tmp_path)
    assert not report.ok
    assert len(report.problems) == 1 and MANIFEST in report.problems[0]


@pytest.mark.parametrize("header, reasons, message", [
    (REGENERATED, None, "finish_reasons not one 'stop'/'length' per generated turn in 1 row(s), e.g. d:1"),
    (REGENERATED, ("length", "stop"), "finish_reasons not one 'stop'/'length' per generated turn in 1 row(s), e.g. d:1"),
    (REGENERATED, ("done",), "finish_reasons not one 'stop'/'length' per generated turn in 1 row(s), e.g. d:1"),
    (HEADER, ("stop",), "finish_reasons not null (the answers come from the dataset) in 1 row(s), e.g. d:1"),
])
def test_verify_finish_reasons(tmp_path, header, reasons, message):
    good = ("stop",) if header is REGENERATED else None
    rows = [dataclasses.replace(r, finish_reasons=reasons if i == 1 else good) for i, r in enumerate(make_rows(6, 3))]
    [info] = write_run(tmp_path, [rows], header=header)
    assert verify(tmp_path).problems == [f"{info.path}: {message}"]


def test_verify_reports_unreadable_shard_version(good_run):
    """A committed shard (right sha and size) of an unknown major version is a verify problem, not a crash."""
    run, infos, _ = good_run
    path = run / "shard-v2.arrow"
    hand_written_shard(path, {b"capture": make_header(format_version="2.0").to_json()})
    data = path.read_bytes()
    mw, _ = ManifestWriter.open(run, HEADER)
    mw.commit(ShardInfo(path.name, 2, 10, 5, len(data), hashlib.sha256(data).hexdigest(), ("d:900", "d:901"),
                        ("x", "y")))
    report = verify(run)
    assert len(report.problems) == 1
    assert report.problems[0].startswith("shard-v2.arrow: unreadable:") and "2.0" in report.problems[0]


def test_verify_reports_a_damaged_manifest(good_run):
    run, _, _ = good_run
    lines = (run / MANIFEST).read_text().splitlines()
    (run / MANIFEST).write_text("\n".join([lines[0], "[1, 2]", *lines[1:]]) + "\n")
    res = invoke("shards", "verify", str(run))
    assert res.exit_code == 1 and "line 2 lacks kind" in res.output


@pytest.fixture
def run_with_garbage(good_run):
    run, infos, rows = good_run
    # an interrupted write: the temporary file of a writer that never closed
    w1 = ShardWriter(run, SCHEMA, target_bytes=BIG)
    w1.write(make_rows(10, 2, start=200))
    [tmp] = [p for p in run.iterdir() if p.name.startswith(TMP_PREFIX)]
    # a shard closed but never committed
    w2 = ShardWriter(run, SCHEMA, target_bytes=BIG)
    w2.write(make_rows(11, 2, start=300))
    [extra] = w2.close()
    garbage = sorted([tmp.name, extra.path])
    return run, infos, garbage


def test_verify_lists_garbage_not_problems(run_with_garbage):
    run, infos, garbage = run_with_garbage
    report = verify(run)
    assert report.ok, report.problems
    assert report.problems == []
    assert sorted(report.garbage) == garbage
    assert report.shards == 3 and report.rows == 9
    assert manifest_mod.garbage(run) == garbage


def test_gc_removes_exactly_garbage(run_with_garbage):
    run, infos, garbage = run_with_garbage
    before = sorted(p.name for p in run.iterdir())
    manifest_bytes = (run / MANIFEST).read_bytes()

    dry = invoke("shards", "gc", "--dry-run", str(run))
    assert dry.exit_code == 0
    assert sorted(dry.output.splitlines()) == sorted(f"would remove {g}" for g in garbage)
    assert sorted(p.name for p in run.iterdir() if p.name != ".capture.lock") == before

    res = invoke("shards", "gc", str(run))
    assert res.exit_code == 0, res.output
    assert sorted(res.output.splitlines()) == sorted(f"removed {g}" for g in garbage)
    after = sorted(p.name for p in run.iterdir() if p.name != ".capture.lock")
    assert after == sorted([MANIFEST] + [i.path for i in infos])
    assert (run / MANIFEST).read_bytes() == manifest_bytes
    report = verify(run)
    assert report.ok and report.garbage == [] and report.rows == 9

    again = invoke("shards", "gc", str(run))
    assert again.exit_code == 0 and again.output == "nothing to remove\n"


def test_gc_refuses_a_live_run_and_a_folder_without_a_run(run_with_garbage, tmp_path):
    from filelock import FileLock

    run, _, garbage = run_with_garbage
    with FileLock(run / ".capture.lock"):  # a capture is writing: its closed shards await their commit
        res = invoke("shards", "gc", str(run))
    assert res.exit_code == 2 and "writing to" in res.stderr
    assert all((run / g).exists() for g in garbage)
    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "msgs.arrow").write_bytes(b"user data")
    (mine / "shard-x.arrow").write_bytes(b"user data")
    res = invoke("shards", "gc", str(mine))
    assert res.exit_code == 2 and "holds no capture run" in res.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["msgs.arrow", "shard-x.arrow"]
    (run / "notes.arrow").write_bytes(b"not a shard name")
    assert "notes.arrow" not in garbage_of(run)


def test_cli_verify_ok_then_fail(good_run):
    run, infos, rows = good_run
    ok = invoke("shards", "verify", str(run))
    assert ok.exit_code == 0, ok.output
    tokens = sum(len(r.input_ids) for r in rows)
    assert ok.output.strip().splitlines()[-1] == f"OK: 3 shards, 9 rows, {tokens:,} tokens; run complete"
    assert "FAIL" not in ok.output

    as_json = invoke("shards", "verify", "--json", str(run))
    assert as_json.exit_code == 0
    data = json.loads(as_json.output)
    assert data["problems"] == [] and data["rows"] == 9 and data["shards"] == 3 and data["complete"] is True

    flip_byte(run / infos[2].path)
    bad = invoke("shards", "verify", str(run))
    assert bad.exit_code == 1
    fails = [line for line in bad.output.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith(f"FAIL {infos[2].path}: sha256")
    assert "1 problem(s)" in bad.output

    bad_json = invoke("shards", "verify", "--json", str(run))
    assert bad_json.exit_code == 1
    assert json.loads(bad_json.output)["problems"][0].startswith(infos[2].path)


def test_cli_verify_notes_garbage(run_with_garbage):
    run, infos, garbage = run_with_garbage
    res = invoke("shards", "verify", str(run))
    assert res.exit_code == 0
    assert "note: 2 uncommitted file(s)" in res.output


def test_cli_missing_run_dir(tmp_path):
    res = CliRunner().invoke(cli.main, ["shards", "verify", str(tmp_path / "nope")])
    assert res.exit_code == 2
