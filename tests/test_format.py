"""shards.format: the Arrow schema and its header metadata, and the format version gate (a major
version refused, a minor one accepted, a file without a capture header refused). No model. Fast."""

from __future__ import annotations


import pyarrow as pa
import pytest
from helpers import HEADER, SCHEMA, hand_written_shard, make_header

from common.errors import CaptureError
from shards import format as shard_format
from shards.format import FormatError
from shards.reader import read_table


def test_schema_columns_and_metadata():
    assert SCHEMA.names == ["sample_id", "source", "row_index", "input_ids", "loss_mask", "argmax", "num_tokens",
                            "num_loss_tokens", "token_sha256", "finish_reasons", "tap_1", "tap_3", "final"]
    assert SCHEMA.field("finish_reasons").nullable and SCHEMA.field("finish_reasons").type == pa.list_(pa.string())
    assert SCHEMA.field("tap_3").metadata == {b"codec": b"bf16", b"dtype": b"bfloat16", b"shape": b"[T, 8]",
                                              b"layer": b"3", b"check": b"xxh3_64"}
    assert SCHEMA.field("final").metadata[b"layer"] == b"post-norm"
    assert shard_format.read_header(SCHEMA) == HEADER
    assert "argmax" not in shard_format.schema(make_header(argmax=False)).names
    with pytest.raises(CaptureError, match="unknown codec .nope."):
        shard_format.header(
            target={}, taps={}, columns=[], hidden_size=1, dtype="bfloat16", codec="nope", argmax=False,
            chat_template="", chat_template_sha256="", tokenizer_sha256="")


def test_format_version_2_refused(tmp_path):
    path = tmp_path / "v2.arrow"
    hand_written_shard(path, {b"capture": make_header(format_version="2.0").to_json()})
    with pytest.raises(FormatError, match=r"version 2\.0"):
        read_table(path)
    with pytest.raises(FormatError, match=r"version 2\.0"):
        read_table(path, columns=["sample_id"])
    assert issubclass(FormatError, CaptureError)


def test_cells_carry_a_checksum_from_format_1_3_and_older_runs_keep_their_layout():
    """A 1.4 header's cells end with their XXH3-64, a 1.3 header's with their CRC-32; a run started by 1.2
    (a resume keeps its header) writes and reads cells without one; all decode to the same states."""
    import dataclasses
    import zlib

    import torch
    import xxhash
    from helpers import make_rows

    from shards import codecs
    from shards.rows import cell_check, read_row, record_batch

    rows = make_rows(2, 3)
    new, crc, old = (make_header(codec="bf16-split", **v) for v in ({}, {"format_version": "1.3"},
                                                                      {"format_version": "1.2"}))
    assert (new.cell_check, crc.cell_check, old.cell_check) == ("xxh3_64", "crc32", None)
    assert [cell_check(shard_format.schema(h)) for h in (new, crc, old)] == ["xxh3_64", "crc32", None]
    assert b"check" not in shard_format.schema(old).field("tap_3").metadata
    tables = [pa.Table.from_batches([record_batch(shard_format.schema(h), rows)]) for h in (new, crc, old)]
    cells = [t.column("tap_3")[0].as_py() for t in tables]
    plain = cells[2]
    assert cells[0] == plain + xxhash.xxh3_64_intdigest(plain).to_bytes(8, "little")
    assert cells[1] == plain + zlib.crc32(plain).to_bytes(4, "little")
    x = rows[0].states["tap_3"]
    assert codecs.decode("bf16-split", cells[0], *x.shape, check="xxh3_64").equal(x)
    for t in tables:
        got = read_row(t, 0)
        assert all(torch.equal(got.states[c], rows[0].states[c]) for c in rows[0].states)
    assert dataclasses.replace(new, format_version="1.10").cell_check == "xxh3_64"  # minor versions compare as numbers


def test_format_minor_version_accepted(tmp_path):
    path = tmp_path / "v1_7.arrow"
    hand_written_shard(path, {b"capture": make_header(format_version="1.7").to_json()})
    assert read_table(path)["sample_id"].to_pylist() == ["d:0", "d:1"]


def test_format_without_header_refused(tmp_path):
    path = tmp_path / "plain.arrow"
    hand_written_shard(path, None)
    with pytest.raises(FormatError, match="no 'capture' header"):
        read_table(path)
    path2 = tmp_path / "other-meta.arrow"
    hand_written_shard(path2, {b"pandas": b"{}"})
    with pytest.raises(FormatError, match="no 'capture' header"):
        read_table(path2)


def test_int4_runs_keep_their_version_s_layout():
    """A run started by format 1.4 keeps writing int4-b32 codes one a byte (the writer's encoder and
    record_batch); a 1.5 run packs them two a byte; rows read back the same from both."""
    import torch
    import zstandard
    from helpers import make_rows

    from shards.rows import read_row, record_batch
    from shards.writer import CellEncoder

    rows = make_rows(3, 2)
    x = rows[0].states["tap_1"]
    t, h = x.shape
    nb = -(-h // 32)
    sizes = {"1.4": 2 * t * nb + 32 * t * nb, shard_format.FORMAT_VERSION: 2 * t * nb + 16 * t * nb}
    got = []
    for version, size in sizes.items():
        sch = shard_format.schema(make_header(codec="int4-b32", format_version=version))
        for cell in (CellEncoder(sch)([x])[0], pa.Table.from_batches([record_batch(sch, rows)]).column("tap_1")[0].as_py()):
            assert zstandard.frame_content_size(cell[:-8]) == size, version
        got.append(read_row(pa.Table.from_batches([record_batch(sch, rows)]), 0).states["tap_1"])
    assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16))
