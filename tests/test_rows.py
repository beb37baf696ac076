"""shards.rows: read_row is the inverse of record_batch, for every codec (bit for bit where lossless)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch
from helpers import bits, make_header, make_rows

from shards import codecs
from shards.format import schema
from shards.rows import Row, read_row, record_batch


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_read_row_inverts_record_batch(codec):
    header = make_header(codec=codec)
    rows = make_rows(7, 5)
    rows[1] = dataclasses.replace(rows[1], finish_reasons=("stop", "length"))
    table = pa.Table.from_batches([record_batch(schema(header), rows)])
    for i, want in enumerate(rows):
        got = read_row(table, i)
        assert isinstance(got, Row)
        assert (got.sample_id, got.source, got.row_index, got.token_sha256, got.finish_reasons) == \
            (want.sample_id, want.source, want.row_index, want.token_sha256, want.finish_reasons)
        assert got.input_ids.dtype == np.int32 and np.array_equal(got.input_ids, want.input_ids)
        assert got.loss_mask.dtype == np.bool_ and np.array_equal(got.loss_mask, want.loss_mask)
        assert got.argmax.dtype == np.int32 and np.array_equal(got.argmax, want.argmax)
        assert list(got.states) == list(header.columns)
        for c, t in want.states.items():
            assert got.states[c].dtype == t.dtype and got.states[c].shape == t.shape
            if codecs.LOSSLESS[codec]:
                assert torch.equal(bits(got.states[c]), bits(t))
            else:  # within the codec's stated bound at every value
                x = t.float()
                assert bool(((got.states[c].float() - x).abs() <= codecs.REGISTRY[codec].bound(x)).all())


def test_read_row_decodes_only_the_states_asked_for():
    header = make_header()
    rows = make_rows(3, 2)
    table = pa.Table.from_batches([record_batch(schema(header), rows)])
    got = read_row(table, 0, states=["tap_3"])
    assert list(got.states) == ["tap_3"] and torch.equal(bits(got.states["tap_3"]), bits(rows[0].states["tap_3"]))
    assert read_row(table, 1, states=[]).states == {}


def test_read_row_without_num_tokens_or_argmax():
    """A Ray Data batch may come without num_tokens; a --no-argmax run has no argmax column."""
    header = make_header(argmax=False)
    rows = [dataclasses.replace(r, argmax=None) for r in make_rows(4, 3)]
    table = pa.Table.from_batches([record_batch(schema(header), rows)]).drop_columns(["num_tokens"])
    got = read_row(table, 2)
    assert got.argmax is None and torch.equal(bits(got.states["final"]), bits(rows[2].states["final"]))
