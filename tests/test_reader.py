"""shards.reader.read_table: column selection (no model; rows from tests/helpers.py). The full round
trips through iter_rows/state_tensor are in test_writer.py."""

from __future__ import annotations

import pytest
import torch
from helpers import bits, make_rows, write_run

from shards.format import FormatError
from shards.reader import read_table
from shards.rows import state_tensor


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
