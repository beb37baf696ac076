"""shards.format.CellLayout: one typed cell layout from the run header, taken by every encoder and by the one
sample decoder (shards.rows.decode_sample) of every reader (issue 30 part 3). No model: helpers' random rows."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest
import torch
import zstandard
from helpers import H, bits, make_header, make_rows, write_run

from common.errors import CaptureError
from shards import codecs
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards.format import FormatError, layout_of, layout_of_schema
from shards.reader import read_table, shard_paths
from shards.rows import decode_sample, read_row, record_batch, table_sample
from shards.writer import CellEncoder


@pytest.fixture
def run(tmp_path):
    write_run(tmp_path / "run", [make_rows(1, 4)])
    return tmp_path / "run"


def test_the_layout_of_a_header_is_the_layout_of_its_shards(run):
    header = manifest_mod.read(run).header
    table = read_table(shard_paths(run)[0])
    layout = header.layout
    assert layout == layout_of(header) == layout_of_schema(table.schema) == layout_of_schema(shard_format.schema(header))
    assert (layout.codec, layout.check, layout.packed, layout.format_version) == \
        ("bf16", "xxh3_64", True, shard_format.FORMAT_VERSION)
    assert (layout.dtype, layout.hidden_size, layout.topk, layout.argmax, layout.final_kind) == \
        (torch.bfloat16, H, 0, True, "post-norm")
    assert layout.columns == ("tap_1", "tap_3", "final") and layout.tap_layers == (1, 3)
    half = make_header(dtype="float16", topk=4, columns=["tap_1"], argmax=False).layout
    assert (half.dtype, half.topk, half.argmax, half.final_kind) == (torch.float16, 4, False, None)
    assert pickle.loads(pickle.dumps(layout)) == layout
    with pytest.raises(FormatError, match="no 'capture' header"):
        layout_of_schema(pa.schema([pa.field("sample_id", pa.string())]))


@pytest.mark.parametrize("version,check,packed", [("1.2", None, False), ("1.3", "crc32", False),
                                                  ("1.4", "xxh3_64", False), ("1.5", "xxh3_64", True),
                                                  ("1.10", "xxh3_64", True)])  # minor versions compare as numbers
def test_a_format_version_decides_checksum_and_int4_packing_once(version, check, packed):
    header = make_header(codec="int4-b32", format_version=version)
    layout = header.layout
    assert (layout.check, layout.packed, layout.format_version) == (check, packed, version)
    assert header.cell_check == layout.check == layout_of_schema(shard_format.schema(header)).check
    x = make_rows(3, 1)[0].states["tap_1"]
    cell = layout.encode(x)
    assert cell == codecs.encode("int4-b32", x, check=check, packed=packed)
    body = cell[:-codecs.CHECKS[check][0]] if check else cell
    t, nb = x.shape[0], -(-H // 32)
    assert zstandard.frame_content_size(body) == 2 * t * nb + (16 if packed else 32) * t * nb
    # every encoder writes that layout: the writer's CellEncoder and record_batch
    sch = shard_format.schema(header)
    assert CellEncoder(sch)([x])[0] == cell
    table = pa.Table.from_batches([record_batch(sch, make_rows(3, 1))])
    assert table.column("tap_1")[0].as_py() == cell
    # and decodes to the bits of the packed layout
    assert torch.equal(bits(layout.decode(cell, t)), bits(make_header(codec="int4-b32").layout.decode(
        make_header(codec="int4-b32").layout.encode(x), t)))


def test_a_damaged_cell_fails_its_layout_s_checksum():
    layout = make_header(codec="bf16-split").layout
    x = make_rows(2, 1)[0].states["tap_3"]
    cell = bytearray(layout.encode(x))
    out = torch.empty(x.shape[0], 2, H, dtype=torch.bfloat16)
    assert torch.equal(bits(layout.decode(bytes(cell), x.shape[0], out=out[:, 1])), bits(x))
    assert torch.equal(bits(out[:, 1]), bits(x))
    cell[-10] ^= 1
    with pytest.raises(codecs.CellError, match="fails its xxh3_64"):
        layout.decode(bytes(cell), x.shape[0])


def test_one_sample_decoder_from_a_table_and_from_python_values(run):
    """decode_sample gives the same sample over an Arrow row (table_sample: ShardStream, OnlineStream, Ray
    Data) and over the Python values a datasets transform gets (the HF decoder), equal to read_row."""
    from shards.hf import decoder

    table = read_table(shard_paths(run)[0])
    layout = layout_of_schema(table.schema)
    columns = layout.columns_for([3, 1])
    assert columns == ("tap_3", "tap_1", "final") and layout.columns_for([3], final=False) == ("tap_3",)
    batch = table.to_pydict()
    hf = decoder(run, layers=[3, 1])(batch)
    for i in range(table.num_rows):
        a = table_sample(table, i, columns)
        b = decode_sample(layout, lambda c: batch[c][i], columns)
        r = read_row(table, i)
        assert list(a) == list(b) == ["sample_id", "source", "input_ids", "loss_mask", "argmax", "taps", "final"]
        assert list(a) == list(hf)
        for s in (b, {k: v[i] for k, v in hf.items()}):
            assert s["sample_id"] == a["sample_id"] == r.sample_id and s["source"] == a["source"]
            for k in ("input_ids", "loss_mask", "argmax"):
                assert s[k].dtype == a[k].dtype and torch.equal(s[k], a[k]), k
            assert torch.equal(bits(s["taps"]), bits(a["taps"])) and torch.equal(bits(s["final"]), bits(a["final"]))
        assert a["input_ids"].dtype == torch.int64 and np.array_equal(a["input_ids"].numpy(), r.input_ids)
        assert a["loss_mask"].dtype == torch.bool and a["taps"].shape == (r.num_tokens, 2, H)
        assert torch.equal(bits(a["taps"][:, 0]), bits(r.states["tap_3"]))
        assert torch.equal(bits(a["taps"][:, 1]), bits(r.states["tap_1"]))
        assert torch.equal(bits(a["final"]), bits(r.states["final"]))


def test_a_damaged_cell_names_column_and_row_in_a_table_and_stays_the_codec_s_error_in_a_transform(run):
    from shards.hf import decoder

    table = read_table(shard_paths(run)[0])
    cells = table.column("tap_3").to_pylist()
    damaged = bytearray(cells[1])
    damaged[-12] ^= 1
    i = table.schema.get_field_index("tap_3")
    bad = table.set_column(i, table.schema.field(i), pa.array([cells[0], bytes(damaged), *cells[2:]],
                                                              type=shard_format.STATE_TYPE))
    columns = layout_of_schema(table.schema).columns_for()
    table_sample(bad, 0, columns)
    with pytest.raises(FormatError, match=r"tap_3 of row 1 does not decode .* the shard is damaged"):
        table_sample(bad, 1, columns)
    with pytest.raises(codecs.CellError, match="fails its xxh3_64"):  # the HF transform: as before
        decoder(run)(bad.slice(1, 1).to_pydict())


def test_every_reader_refuses_a_tap_the_run_lacks_in_one_message(run, tmp_path):
    from shards.export import export
    from shards.hf import decoder
    from shards.online import OnlineStream
    from shards.stream import ShardStream

    header = manifest_mod.read(run).header
    readers = {
        "ShardStream": lambda: ShardStream(run, layers=[4]),
        "hf decoder": lambda: decoder(run, layers=[3, 4]),
        "OnlineStream": lambda: OnlineStream({}, run, header, layers=[4, 1]),
        "export": lambda: export(run, tmp_path / "out", "specforge", layers=[4]),
        "layout": lambda: header.layout.columns_for([4]),
    }
    messages = {}
    for name, make in readers.items():
        with pytest.raises(CaptureError) as e:
            make()
        messages[name] = str(e.value)
    assert set(messages.values()) == {"no tap(s) [4] in this run; it stored taps [1, 3]"}, messages
    with pytest.raises(CaptureError, match=r"no tap\(s\) \[\] in this run"):
        header.layout.columns_for([])
