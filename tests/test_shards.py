"""Tests for the shard pipeline (shards.format/writer/manifest/reader/verify/summary and `capture shards`).

No model: rows are built from small random tensors (hidden size 8, 5–40 tokens), with a run header for
two taps and a ``final`` column. Fast: the whole file runs in a few seconds.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import small_disk
from shards.manifest import garbage as garbage_of
import torch
from click.testing import CliRunner

import cli
from capture.errors import CaptureError
from capture.hashing import token_sha256
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards.format import FormatError
from shards.manifest import MANIFEST, ManifestWriter
from shards.reader import iter_rows, read_table, shard_paths, state_tensor
from shards.summary import head, ls, stat
from shards.verify import verify
from shards.writer import TMP_PREFIX, Row, ShardInfo, ShardWriter

H = 8
COLUMNS = ["tap_1", "tap_3", "final"]
BIG = 1 << 40  # a target size no test reaches: the shard closes only on close()


def make_header(**overrides) -> dict:
    h = shard_format.header(
        target={"name": "tiny", "source": "test", "revision": "0", "architecture": "none", "num_layers": 4},
        taps={"layers": [1, 3], "final": "post-norm", "tap_convention": "t", "final_convention": "f"},
        columns=list(COLUMNS),
        hidden_size=H,
        dtype="bfloat16",
        codec="bf16",
        argmax=True,
        chat_template="{{ messages }}",
        chat_template_sha256="a" * 64,
        tokenizer_sha256="b" * 64,
    )
    h.update(overrides)
    return h


HEADER = make_header()
SCHEMA = shard_format.schema(HEADER)


def make_row(rng: np.random.Generator, index: int, tokens: int, source: str = "alpha", *,
             dataset: str = "d", incompressible: bool = False, header: dict = HEADER) -> Row:
    ids = rng.integers(0, 50_000, tokens, dtype=np.int32)
    mask = rng.random(tokens) < 0.5
    mask[-1] = True  # at least one supervised token
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[header["dtype"]]
    states = {}
    for c in header["columns"]:
        if incompressible:  # uniformly random bits: zstd cannot shrink them
            states[c] = torch.randint(-(1 << 15), 1 << 15, (tokens, header["hidden_size"]), dtype=torch.int16,
                                      generator=gen).view(dtype)
        else:
            states[c] = (torch.randn(tokens, header["hidden_size"], generator=gen) * 3).to(dtype)
    argmax = rng.integers(0, 50_000, tokens, dtype=np.int32) if header["argmax"] else None
    return Row(f"{dataset}:{index}", source, index, ids, mask, argmax, states, token_sha256(ids))


def make_rows(seed: int, n: int, start: int = 0, sources=("alpha", "beta")) -> list[Row]:
    rng = np.random.default_rng(seed)
    return [make_row(rng, start + i, int(rng.integers(5, 41)), sources[i % len(sources)]) for i in range(n)]


def write_run(run_dir: Path, batches: list[list[Row]], target_bytes: int = BIG, *, complete: bool = True,
              header: dict = HEADER) -> list[ShardInfo]:
    """Write ``batches`` through one ShardWriter, commit every closed shard, optionally mark complete."""
    mw, _ = ManifestWriter.open(run_dir, header)
    writer = ShardWriter(run_dir, shard_format.schema(header), target_bytes=target_bytes)
    infos = []
    for batch in batches:
        for info in writer.write(batch):
            mw.commit(info)
            infos.append(info)
    for info in writer.close():
        mw.commit(info)
        infos.append(info)
    if complete:
        mw.complete({"rows": sum(i.rows for i in infos), "reason": "test"})
    return infos


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def assert_row_equal(got: dict, row: Row) -> None:
    assert got["sample_id"] == row.sample_id
    assert got["source"] == row.source
    assert got["row_index"] == row.row_index
    np.testing.assert_array_equal(got["input_ids"], row.input_ids)
    assert got["input_ids"].dtype == np.int32
    np.testing.assert_array_equal(got["loss_mask"], row.loss_mask)
    assert got["loss_mask"].dtype == np.bool_
    np.testing.assert_array_equal(got["argmax"], row.argmax)
    assert got["num_tokens"] == len(row.input_ids)
    assert got["num_loss_tokens"] == int(row.loss_mask.sum())
    assert got["token_sha256"] == row.token_sha256
    for c, t in row.states.items():
        assert got[c].dtype == t.dtype and got[c].shape == t.shape
        assert torch.equal(got[c], t)
        assert torch.equal(bits(got[c]), bits(t))


def manifest_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / MANIFEST).read_text().splitlines()]


def rewrite_manifest(run_dir: Path, lines: list[dict]) -> None:
    (run_dir / MANIFEST).write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in lines))


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def invoke(*args: str):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


# --------------------------------------------------------------------------------------------------
# 1. round trip


def test_round_trip_one_shard(tmp_path):
    rows = make_rows(1, 7)
    batches = [rows[:3], rows[3:]]
    writer = ShardWriter(tmp_path, SCHEMA, target_bytes=BIG)
    assert writer.write(batches[0]) == []
    assert writer.write(batches[1]) == []
    assert writer.write([]) == []
    [tmp] = [p for p in tmp_path.iterdir()]
    assert tmp.name.startswith(TMP_PREFIX)  # still growing under its temporary name
    [info] = writer.close()
    assert writer.close() == []  # nothing open any more

    path = tmp_path / info.path
    assert sorted(p.name for p in tmp_path.iterdir()) == [info.path]
    assert info.path.startswith("shard-") and info.path.endswith(".arrow")
    assert info.rows == 7
    assert info.tokens == sum(len(r.input_ids) for r in rows)
    assert info.loss_tokens == sum(int(r.loss_mask.sum()) for r in rows)
    assert info.bytes == path.stat().st_size
    assert info.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert info.sample_ids == tuple(r.sample_id for r in rows)
    assert info.token_sha256 == tuple(token_sha256(r.input_ids) for r in rows)
    assert info.token_sha256[0] == hashlib.sha256(rows[0].input_ids.astype("<i4").tobytes()).hexdigest()

    mw, before = ManifestWriter.open(tmp_path, HEADER)
    assert before.header is None and before.shards == []
    mw.commit(info)
    m = manifest_mod.read(tmp_path)
    assert m.header == {"kind": "header", **HEADER}
    assert len(m.shards) == 1
    assert m.shards[0] == {"kind": "shard", "path": info.path, "rows": 7, "tokens": info.tokens,
                           "loss_tokens": info.loss_tokens, "bytes": info.bytes, "sha256": info.sha256,
                           "sample_ids": list(info.sample_ids), "token_sha256": list(info.token_sha256)}
    assert shard_paths(tmp_path) == [path]

    table = read_table(path)
    assert table.num_rows == 7
    assert table.column_names == SCHEMA.names
    assert shard_format.read_header(table.schema) == HEADER
    for i, r in enumerate(rows):
        assert table["sample_id"][i].as_py() == r.sample_id
        np.testing.assert_array_equal(table["input_ids"][i].values.to_numpy(), r.input_ids)
        np.testing.assert_array_equal(table["loss_mask"][i].values.to_numpy(zero_copy_only=False), r.loss_mask)
        np.testing.assert_array_equal(table["argmax"][i].values.to_numpy(), r.argmax)
        for c in COLUMNS:
            t = state_tensor(table, c, i)
            assert t.dtype == torch.bfloat16 and t.shape == (len(r.input_ids), H)
            assert torch.equal(bits(t), bits(r.states[c]))

    got = list(iter_rows(tmp_path))
    assert len(got) == 7
    for g, r in zip(got, rows):
        assert_row_equal(g, r)

    sub = read_table(path, columns=["sample_id", "tap_3"])
    assert set(sub.column_names) == {"sample_id", "tap_3", "num_tokens"}  # states decode with num_tokens
    assert sub.num_rows == 7
    assert sub["sample_id"].to_pylist() == [r.sample_id for r in rows]
    for i, r in enumerate(rows):
        assert torch.equal(bits(state_tensor(sub, "tap_3", i)), bits(r.states["tap_3"]))


def test_read_table_refuses_empty_or_unknown_columns(tmp_path):
    """Arrow reads every field for included_fields=[]; an empty or unknown selection is an error instead."""
    [info] = write_run(tmp_path, [make_rows(20, 3)])
    with pytest.raises(FormatError, match="no column"):
        read_table(tmp_path / info.path, columns=[])
    with pytest.raises(FormatError, match=r"no column\(s\) \['nope'\]"):
        read_table(tmp_path / info.path, columns=["nope"])


def test_read_table_columns_any_order(tmp_path):
    rows = make_rows(21, 3)
    [info] = write_run(tmp_path, [rows])
    sub = read_table(tmp_path / info.path, columns=["final", "num_tokens"])
    assert sorted(sub.column_names) == ["final", "num_tokens"]
    assert sub["num_tokens"].to_pylist() == [len(r.input_ids) for r in rows]
    assert torch.equal(bits(state_tensor(sub, "final", 2)), bits(rows[2].states["final"]))


def test_non_contiguous_states_round_trip(tmp_path):
    """A transposed (non-contiguous) [T, H] view is stored in row-major order of its logical layout."""
    rng = np.random.default_rng(22)
    r = make_row(rng, 0, 17)
    gen = torch.Generator().manual_seed(22)
    base = torch.randn(H, 17, generator=gen).to(torch.bfloat16)
    r.states["tap_1"] = base.t()
    assert not r.states["tap_1"].is_contiguous()
    write_run(tmp_path, [[r]])
    [got] = list(iter_rows(tmp_path))
    assert torch.equal(got["tap_1"], base.t())
    assert verify(tmp_path).ok


def test_round_trip_many_shards_in_manifest_order(tmp_path):
    rows = make_rows(2, 12)
    infos = write_run(tmp_path, [rows[i:i + 2] for i in range(0, 12, 2)], target_bytes=1500)
    assert len(infos) >= 3
    assert [p.name for p in shard_paths(tmp_path)] == [i.path for i in infos]
    got = list(iter_rows(tmp_path))
    assert [g["sample_id"] for g in got] == [r.sample_id for r in rows]
    for g, r in zip(got, rows):
        assert_row_equal(g, r)
    assert verify(tmp_path).ok


def test_round_trip_float16_without_argmax(tmp_path):
    header = make_header(dtype="float16", argmax=False)
    rng = np.random.default_rng(3)
    rows = [make_row(rng, i, 5 + 7 * i, header=header) for i in range(4)]
    write_run(tmp_path, [rows], header=header)
    [path] = shard_paths(tmp_path)
    table = read_table(path)
    assert "argmax" not in table.column_names
    for i, r in enumerate(rows):
        for c in COLUMNS:
            t = state_tensor(table, c, i)
            assert t.dtype == torch.float16
            assert torch.equal(bits(t), bits(r.states[c]))
    assert verify(tmp_path).ok


def test_round_trip_special_bit_patterns(tmp_path):
    """NaN, inf, -0 and subnormal bf16 values come back with the very same bits."""
    rng = np.random.default_rng(4)
    row = make_row(rng, 0, 6, incompressible=True)
    special = torch.tensor([0x7FC0, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x7FFF, 0xFFFF, 0x0000],
                           dtype=torch.int32).to(torch.int16)
    row.states["tap_1"][0] = special.view(torch.bfloat16)
    write_run(tmp_path, [[row]])
    [got] = list(iter_rows(tmp_path))
    for c in COLUMNS:
        assert torch.equal(bits(got[c]), bits(row.states[c]))
    assert torch.isnan(got["tap_1"][0, 0]) and torch.isinf(got["tap_1"][0, 1])


# --------------------------------------------------------------------------------------------------
# 2. size rollover


def test_rollover_closes_shards_as_it_goes(tmp_path):
    rows = make_rows(5, 21)
    target = 12_000  # the schema message alone is ~3 kB; a row adds 1-3 kB: 3-4 rows per shard
    writer = ShardWriter(tmp_path, SCHEMA, target_bytes=target)
    closed: list[ShardInfo] = []
    returned_by_write = 0
    for r in rows:
        out = writer.write([r])
        assert len(out) <= 1
        for info in out:
            returned_by_write += 1
            assert info.bytes >= target
            # once write() returns a shard, it is already under its final name and no temp file is open
            assert (tmp_path / info.path).is_file()
            assert not any(p.name.startswith(TMP_PREFIX) for p in tmp_path.iterdir())
        closed += out
    tail = writer.close()
    assert len(tail) == 1 and tail[0].bytes < target  # the last, short shard closes on close()
    closed += tail
    assert returned_by_write >= 3
    assert max(i.rows for i in closed) > 1  # shards do hold several rows
    names = [i.path for i in closed]
    assert len(set(names)) == len(names)
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert on_disk == sorted(names)  # no .tmp- left, nothing else written
    assert sum(i.rows for i in closed) == 21
    assert [s for i in closed for s in i.sample_ids] == [r.sample_id for r in rows]
    for info in closed:
        p = tmp_path / info.path
        assert info.bytes == p.stat().st_size
        assert info.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
        assert read_table(p)["sample_id"].to_pylist() == list(info.sample_ids)


def test_names_never_repeat_across_writers(tmp_path):
    rows = make_rows(6, 10)
    names = []
    for k in range(3):  # several writers on the same folder, same second
        w = ShardWriter(tmp_path, SCHEMA, target_bytes=1)
        for r in rows:
            names += [i.path for i in w.write([r])]
        names += [i.path for i in w.close()]
    assert len(names) == 30
    assert len(set(names)) == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


# --------------------------------------------------------------------------------------------------
# 3. verify and gc


@pytest.fixture
def good_run(tmp_path) -> tuple[Path, list[ShardInfo], list[Row]]:
    run = tmp_path / "run"
    rows = make_rows(7, 9)
    infos = write_run(run, [rows[0:3], rows[3:6], rows[6:9]], target_bytes=1)  # one shard per batch
    assert [i.rows for i in infos] == [3, 3, 3]
    return run, infos, rows


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


def _add_row(e):
    e["rows"] += 1


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
    assert [p.name for p in manifest_mod.garbage(run)] == garbage


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
    assert "notes.arrow" not in [p.name for p in garbage_of(run)]


def test_verify_reports_a_damaged_manifest(good_run):
    run, _, _ = good_run
    lines = (run / MANIFEST).read_text().splitlines()
    (run / MANIFEST).write_text("\n".join([lines[0], "[1, 2]", *lines[1:]]) + "\n")
    res = invoke("shards", "verify", str(run))
    assert res.exit_code == 1 and "line 2 lacks kind" in res.output


# --------------------------------------------------------------------------------------------------
# 4. manifest


def test_manifest_missing_is_empty(tmp_path):
    m = manifest_mod.read(tmp_path)
    assert m.header is None and m.shards == [] and m.completions == [] and m.committed_bytes == 0
    assert m.complete is False


def test_manifest_torn_last_line(good_run):
    run, infos, rows = good_run
    path = run / MANIFEST
    good = path.read_bytes()
    torn = json.dumps({"kind": "shard", "path": "shard-torn.arrow", "rows": 3}).encode()
    path.write_bytes(good + torn[: len(torn) // 2])

    m = manifest_mod.read(run)
    assert m.committed_bytes == len(good)
    assert [s["path"] for s in m.shards] == [i.path for i in infos]
    assert m.complete is True  # the torn line does not count as a later line
    assert verify(run).ok

    mw, reopened = ManifestWriter.open(run, HEADER)
    assert path.read_bytes() == good  # cut off at once
    assert [s["path"] for s in reopened.shards] == [i.path for i in infos]
    w = ShardWriter(run, SCHEMA, target_bytes=BIG)
    w.write(make_rows(12, 2, start=400))
    [info] = w.close()
    mw.commit(info)

    data = path.read_bytes()
    assert data.startswith(good) and data.endswith(b"\n")
    entries = [json.loads(line) for line in data.splitlines()]  # every line valid
    assert [e["kind"] for e in entries] == ["header", "shard", "shard", "shard", "complete", "shard"]
    m = manifest_mod.read(run)
    assert len(m.shards) == 4 and m.shards[-1]["path"] == info.path
    assert m.committed_bytes == len(data)
    assert verify(run).ok


def test_manifest_torn_header_only(tmp_path):
    (tmp_path / MANIFEST).write_bytes(json.dumps({"kind": "header", **HEADER}).encode()[:40])
    assert manifest_mod.read(tmp_path).header is None
    mw, m = ManifestWriter.open(tmp_path, HEADER)
    assert m.header is None
    lines = manifest_lines(tmp_path)
    assert lines == [{"kind": "header", **HEADER}]


def test_manifest_corrupt_middle_line(good_run):
    run, infos, _ = good_run
    path = run / MANIFEST
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"kind": "shard", "path": oops\n'
    path.write_bytes(b"".join(lines))
    with pytest.raises(CaptureError, match="line 3"):
        manifest_mod.read(run)
    with pytest.raises(CaptureError):
        ManifestWriter.open(run, HEADER)
    assert path.read_bytes() == b"".join(lines)  # left alone


def test_manifest_unknown_major_version(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"kind": "header", **make_header(format_version="2.0")}) + "\n")
    with pytest.raises(CaptureError, match="2.0"):
        manifest_mod.read(tmp_path)


@pytest.mark.parametrize("field, value", [
    ("taps", {"layers": [1, 2], "final": "post-norm", "tap_convention": "t", "final_convention": "f"}),
    ("columns", ["tap_1", "tap_3"]),
    ("codec", "fp8"),
    ("tokenizer_sha256", "c" * 64),
    ("chat_template_sha256", "d" * 64),
    ("hidden_size", 16),
    ("target", {"name": "other"}),
    ("responses", {"mode": "regenerate", "policy": "last", "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 512,
                   "seed": 0, "stop_ids": [2], "chat_template_kwargs": {}}),
    ("responses", {"mode": "dataset", "chat_template_kwargs": {"enable_thinking": False}}),
])
def test_manifest_reopen_with_different_header(good_run, field, value):
    run, infos, _ = good_run
    before = (run / MANIFEST).read_bytes()
    with pytest.raises(CaptureError) as e:
        ManifestWriter.open(run, make_header(**{field: value}))
    assert field in str(e.value)
    others = [k for k in shard_format.RUN_IDENTITY if k != field and k not in field]
    assert not any(f"different {k}" in str(e.value) for k in others)
    assert (run / MANIFEST).read_bytes() == before


def test_manifest_reopen_differing_only_in_chat_template_text_is_allowed(good_run):
    run, infos, _ = good_run
    mw, m = ManifestWriter.open(run, make_header(chat_template="other text, same hash"))
    assert len(m.shards) == 3


def test_manifest_reopen_of_a_header_from_before_responses(tmp_path):
    """A 1.0 header has no ``responses``: it means dataset answers, so today's dataset header resumes it and a
    regenerate header is refused."""
    old = {k: v for k, v in HEADER.items() if k != "responses"} | {"format_version": "1.0"}
    write_run(tmp_path, [make_rows(3, 2)], header=old)
    mw, m = ManifestWriter.open(tmp_path, HEADER)
    assert len(m.shards) == 1 and "responses" not in m.header
    with pytest.raises(CaptureError, match="different responses"):
        ManifestWriter.open(tmp_path, make_header(responses={"mode": "regenerate", "chat_template_kwargs": {}}))


REGENERATED = make_header(responses={"mode": "regenerate", "policy": "every", "temperature": 0.0, "top_p": 1.0,
                                     "max_new_tokens": 16, "seed": 0, "stop_ids": [2], "chat_template_kwargs": {}})


def test_finish_reasons_round_trip_verify_stat_and_recode(tmp_path):
    rows = [dataclasses.replace(r, finish_reasons=reasons) for r, reasons in
            zip(make_rows(5, 3), [("stop",), ("stop", "length"), ("stop", "stop", "stop")])]
    write_run(tmp_path / "run", [rows], header=REGENERATED)
    got = list(iter_rows(tmp_path / "run"))
    assert [g["finish_reasons"] for g in got] == [["stop"], ["stop", "length"], ["stop", "stop", "stop"]]
    assert verify(tmp_path / "run").ok
    s = stat(tmp_path / "run")
    assert s["responses"] == "regenerate" and s["finish_reasons"] == {"stop": 5, "length": 1}
    assert head(tmp_path / "run", 1)[0]["finish_reasons"] == ["stop"]
    invoke("shards", "recode", str(tmp_path / "run"), str(tmp_path / "fp8"), "--codec", "fp8-e4m3")
    assert [g["finish_reasons"] for g in iter_rows(tmp_path / "fp8")] == [g["finish_reasons"] for g in got]
    write_run(tmp_path / "plain", [make_rows(4, 2)])  # dataset answers: null
    assert [g["finish_reasons"] for g in iter_rows(tmp_path / "plain")] == [None, None]


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


def test_manifest_reopen_same_header(good_run):
    run, infos, _ = good_run
    before = (run / MANIFEST).read_bytes()
    mw, m = ManifestWriter.open(run, HEADER)
    assert (run / MANIFEST).read_bytes() == before  # nothing written, nothing cut
    assert m.header == {"kind": "header", **HEADER}
    assert [s["path"] for s in m.shards] == [i.path for i in infos]
    assert len(m.completions) == 1
    w = ShardWriter(run, SCHEMA, target_bytes=BIG)
    w.write(make_rows(13, 1, start=500))
    [info] = w.close()
    mw.commit(info)
    kinds = [e["kind"] for e in manifest_lines(run)]
    assert kinds == ["header", "shard", "shard", "shard", "complete", "shard"]
    assert kinds.count("header") == 1


def test_manifest_complete_flag(tmp_path):
    mw, m = ManifestWriter.open(tmp_path, HEADER)
    assert m.complete is False
    assert manifest_mod.read(tmp_path).complete is False  # header only
    w = ShardWriter(tmp_path, SCHEMA, target_bytes=BIG)
    w.write(make_rows(14, 2))
    [a] = w.close()
    mw.commit(a)
    assert manifest_mod.read(tmp_path).complete is False
    mw.complete({"rows": 2, "reason": "done"})
    m = manifest_mod.read(tmp_path)
    assert m.complete is True and len(m.completions) == 1
    assert m.completions[0] == {"kind": "complete", "rows": 2, "reason": "done"}
    w.write(make_rows(15, 2, start=10))
    [b] = w.close()
    mw.commit(b)
    m = manifest_mod.read(tmp_path)
    assert m.complete is False and len(m.completions) == 1 and len(m.shards) == 2
    assert verify(tmp_path).complete is False
    mw.complete({"rows": 4, "reason": "done again"})
    m = manifest_mod.read(tmp_path)
    assert m.complete is True and [c["rows"] for c in m.completions] == [2, 4]
    assert verify(tmp_path).complete is True
    assert m.sample_ids() == {"d:0", "d:1", "d:10", "d:11"}
    assert m.token_hashes() == set(a.token_sha256) | set(b.token_sha256)


# --------------------------------------------------------------------------------------------------
# 5. format version


def _hand_written_shard(path: Path, metadata: dict | None) -> None:
    schema = pa.schema([pa.field("sample_id", pa.string())], metadata=metadata)
    batch = pa.record_batch([pa.array(["d:0", "d:1"])], schema=schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(batch)


def test_format_version_2_refused(tmp_path):
    path = tmp_path / "v2.arrow"
    _hand_written_shard(path, {b"capture": json.dumps(make_header(format_version="2.0")).encode()})
    with pytest.raises(FormatError, match=r"version 2\.0"):
        read_table(path)
    with pytest.raises(FormatError, match=r"version 2\.0"):
        read_table(path, columns=["sample_id"])
    assert issubclass(FormatError, CaptureError)


def test_format_minor_version_accepted(tmp_path):
    path = tmp_path / "v1_7.arrow"
    _hand_written_shard(path, {b"capture": json.dumps(make_header(format_version="1.7")).encode()})
    assert read_table(path)["sample_id"].to_pylist() == ["d:0", "d:1"]


def test_format_without_header_refused(tmp_path):
    path = tmp_path / "plain.arrow"
    _hand_written_shard(path, None)
    with pytest.raises(FormatError, match="no 'capture' header"):
        read_table(path)
    path2 = tmp_path / "other-meta.arrow"
    _hand_written_shard(path2, {b"pandas": b"{}"})
    with pytest.raises(FormatError, match="no 'capture' header"):
        read_table(path2)


def test_verify_reports_unreadable_shard_version(good_run):
    """A committed shard (right sha and size) of an unknown major version is a verify problem, not a crash."""
    run, infos, _ = good_run
    path = run / "shard-v2.arrow"
    _hand_written_shard(path, {b"capture": json.dumps(make_header(format_version="2.0")).encode()})
    data = path.read_bytes()
    mw, _ = ManifestWriter.open(run, HEADER)
    mw.commit(ShardInfo(path.name, 2, 10, 5, len(data), hashlib.sha256(data).hexdigest(), ("d:900", "d:901"),
                        ("x", "y")))
    report = verify(run)
    assert len(report.problems) == 1
    assert report.problems[0].startswith("shard-v2.arrow: unreadable:") and "2.0" in report.problems[0]


def test_schema_columns_and_metadata():
    assert SCHEMA.names == ["sample_id", "source", "row_index", "input_ids", "loss_mask", "argmax", "num_tokens",
                            "num_loss_tokens", "token_sha256", "finish_reasons", "tap_1", "tap_3", "final"]
    assert SCHEMA.field("finish_reasons").nullable and SCHEMA.field("finish_reasons").type == pa.list_(pa.string())
    assert SCHEMA.field("tap_3").metadata == {b"codec": b"bf16", b"dtype": b"bfloat16", b"shape": b"[T, 8]",
                                              b"layer": b"3"}
    assert SCHEMA.field("final").metadata[b"layer"] == b"post-norm"
    assert shard_format.read_header(SCHEMA) == HEADER
    assert "argmax" not in shard_format.schema(make_header(argmax=False)).names
    with pytest.raises(CaptureError, match="unknown codec .nope."):
        shard_format.header(
            target={}, taps={}, columns=[], hidden_size=1, dtype="bfloat16", codec="nope", argmax=False,
            chat_template="", chat_template_sha256="", tokenizer_sha256="")


# --------------------------------------------------------------------------------------------------
# 6. disk full, on a real 2 MiB tmpfs


@pytest.fixture
def tiny_fs(tmp_path):
    with small_disk(tmp_path / "tiny", "2M") as d:
        yield d


def _fill_until_enospc(run: Path, start: int, tokens: int = 40) -> tuple[ShardWriter, OSError, int]:
    rng = np.random.default_rng(start)
    w = ShardWriter(run, SCHEMA, target_bytes=BIG)
    for i in range(start, start + 100_000):
        try:
            w.write([make_row(rng, i, tokens, incompressible=True)])
        except OSError as e:
            return w, e, i
    raise AssertionError("2 MiB tmpfs never filled up")


def test_disk_full_raises_enospc_and_committed_shards_survive(tiny_fs):
    run = tiny_fs
    rows = make_rows(16, 6)
    infos = write_run(run, [rows[:3], rows[3:]], target_bytes=1, complete=False)
    assert len(infos) == 2
    w, err, failed_at = _fill_until_enospc(run, start=1000)
    assert err.errno == errno.ENOSPC
    assert failed_at > 1000  # some rows went in before the disk filled
    m = manifest_mod.read(run)
    assert [s["path"] for s in m.shards] == [i.path for i in infos]
    report = verify(run)
    assert report.ok, report.problems
    assert report.shards == 2 and report.rows == 6
    got = list(iter_rows(run))
    assert [g["sample_id"] for g in got] == [r.sample_id for r in rows]
    for g, r in zip(got, rows):
        assert_row_equal(g, r)
    # no finished shard came out of the failed write
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("shard-")) == sorted(i.path for i in infos)


def test_disk_full_leaves_no_tmp_file(tiny_fs):
    run = tiny_fs
    write_run(run, [make_rows(17, 3)], complete=False)
    w, err, _ = _fill_until_enospc(run, start=2000)
    assert err.errno == errno.ENOSPC
    assert [p.name for p in run.iterdir() if p.name.startswith(TMP_PREFIX)] == []
    assert w._open is None


# --------------------------------------------------------------------------------------------------
# 7. summary


@pytest.fixture
def known_run(tmp_path):
    """Two sources with known lengths: alpha rows have 10 tokens, beta rows 30; three shards."""
    rng = np.random.default_rng(18)
    rows = [make_row(rng, i, 10 if i % 3 else 30, "beta" if i % 3 == 0 else "alpha") for i in range(9)]
    infos = write_run(tmp_path, [rows[0:4], rows[4:6], rows[6:9]], target_bytes=1)
    return tmp_path, infos, rows


def test_stat_values(known_run):
    run, infos, rows = known_run
    s = stat(run)
    tokens = 3 * 30 + 6 * 10
    loss = sum(int(r.loss_mask.sum()) for r in rows)
    nbytes = sum((run / i.path).stat().st_size for i in infos)
    assert s["run"] == str(run)
    assert s["target"] == "tiny"
    assert s["columns"] == COLUMNS
    assert s["hidden_size"] == H
    assert s["codec"] == "bf16"
    assert s["complete"] is True
    assert s["last_completion"] == {"rows": 9, "reason": "test"}
    assert s["shards"] == 3
    assert s["rows"] == 9
    assert s["tokens"] == tokens
    assert s["loss_tokens"] == loss
    assert s["bytes"] == nbytes
    assert s["bytes_per_token"] == round(nbytes / tokens, 1)
    assert s["raw_state_bytes_per_token"] == 3 * H * 2
    assert s["ratio_to_raw_states"] == round(nbytes / (tokens * 48), 4)
    alpha_loss = sum(int(r.loss_mask.sum()) for r in rows if r.source == "alpha")
    assert s["sources"] == {
        "beta": {"rows": 3, "tokens": 90, "loss_tokens": loss - alpha_loss, "token_share": 0.6},
        "alpha": {"rows": 6, "tokens": 60, "loss_tokens": alpha_loss, "token_share": 0.4},
    }
    assert list(s["sources"]) == ["beta", "alpha"]  # most tokens first


def test_stat_empty_run(tmp_path):
    assert stat(tmp_path) == {"run": str(tmp_path), "shards": 0}
    ManifestWriter.open(tmp_path, HEADER)
    s = stat(tmp_path)
    assert s["shards"] == 0 and s["rows"] == 0 and s["tokens"] == 0 and s["bytes_per_token"] is None
    assert s["sources"] == {} and s["complete"] is False and s["last_completion"] is None


def test_ls_values(known_run):
    run, infos, rows = known_run
    assert ls(run) == [{"path": i.path, "rows": i.rows, "tokens": i.tokens, "loss_tokens": i.loss_tokens,
                        "bytes": (run / i.path).stat().st_size, "sha256": i.sha256} for i in infos]
    assert [e["rows"] for e in ls(run)] == [4, 2, 3]
    assert [e["tokens"] for e in ls(run)] == [30 + 10 + 10 + 30, 10 + 10, 30 + 10 + 10]


def test_head_values(known_run):
    run, infos, rows = known_run
    h = head(run, 6)  # crosses from the first shard (4 rows) into the second
    assert [r["sample_id"] for r in h] == [f"d:{i}" for i in range(6)]
    for got, r in zip(h, rows):
        assert got["source"] == r.source
        assert got["num_tokens"] == len(r.input_ids)
        assert got["num_loss_tokens"] == int(r.loss_mask.sum())
        assert got["input_ids[:12]"] == r.input_ids[:12].tolist()
        assert got["token_sha256"] == r.token_sha256[:16]
        for c in COLUMNS:
            expected = float(torch.linalg.vector_norm(r.states[c].float(), dim=-1).mean())
            assert got[f"|{c}| mean"] == pytest.approx(expected, abs=0.006)
    assert [r["sample_id"] for r in head(run, 2)] == ["d:0", "d:1"]
    assert len(head(run, 100)) == 9
    assert head(run, 0) == []


# --------------------------------------------------------------------------------------------------
# 8. CLI


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


def test_cli_ls_stat_head_json(known_run):
    run, infos, rows = known_run
    res = invoke("shards", "ls", "--json", str(run))
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [d["path"] for d in data] == [i.path for i in infos]
    assert sum(d["rows"] for d in data) == 9
    assert sum(d["tokens"] for d in data) == 150
    assert [d["sha256"] for d in data] == [i.sha256 for i in infos]

    res = invoke("shards", "stat", "--json", str(run))
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert s["rows"] == 9 and s["tokens"] == 150 and s["shards"] == 3
    assert s["loss_tokens"] == sum(int(r.loss_mask.sum()) for r in rows)
    assert s["bytes"] == sum(i.bytes for i in infos)
    assert s["sources"]["alpha"]["rows"] == 6 and s["sources"]["beta"]["token_share"] == 0.6

    res = invoke("shards", "head", "-n", "3", "--json", str(run))
    assert res.exit_code == 0, res.output
    assert [r["sample_id"] for r in json.loads(res.output)] == ["d:0", "d:1", "d:2"]

    text = invoke("shards", "ls", str(run))
    assert text.exit_code == 0
    lines = text.output.splitlines()
    assert lines[0].split() == ["path", "rows", "tokens", "loss_tokens", "bytes", "sha256"]
    assert [line.split()[0] for line in lines[1:]] == [i.path for i in infos]


def test_cli_missing_run_dir(tmp_path):
    res = CliRunner().invoke(cli.main, ["shards", "verify", str(tmp_path / "nope")])
    assert res.exit_code == 2
