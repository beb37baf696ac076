"""shards.writer: rows written and read back bit for bit (one and many shards, dtypes, special bit
patterns, finish_reasons), size rollover, unique shard names, and a full disk (a real 2 MiB tmpfs).

No model: rows from tests/helpers.py (small random tensors, hidden size 8, 5–40 tokens). Fast.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import small_disk
from helpers import (BIG, COLUMNS, H, HEADER, REGENERATED, SCHEMA, assert_row_equal, bits, invoke, make_header,
                     make_row, make_rows, write_run)

from common.hashing import token_sha256
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards.manifest import ManifestWriter
from shards.reader import iter_rows, read_table, shard_paths
from shards.rows import state_tensor
from shards.summary import head, stat
from shards.verify import verify
from shards.writer import ShardInfo, ShardWriter
from shards.run import TMP_PREFIX


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
    assert m.header == HEADER
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
