"""Read shards: whole tables (memory-mapped), rows, and states decoded into bf16 tensors.

A state cell is one ``[T, H]`` tensor encoded by the run's codec (see :mod:`shards.format`);
:func:`state_tensor` decodes it straight into a torch tensor of the recorded dtype (no widening to
float32, no per-element Python).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.fs  # noqa: F401 - pa.fs
import torch

from shards import codecs
from shards import manifest as manifest_mod
from shards.format import FormatError, read_header

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def read_table(path: str | os.PathLike, columns: list[str] | None = None,
               filesystem: pa.fs.FileSystem | None = None) -> pa.Table:
    """All record batches of one shard, or only ``columns`` (the others are not read into memory);
    ``num_tokens`` comes along with any state column. ``filesystem``: read ``path`` on it (e.g. an
    object store) instead of memory-mapping a local file. Raises FormatError for an unknown format
    version or an unknown column."""
    try:
        if filesystem is None:
            with pa.memory_map(str(path)) as source:
                return _read_table(source, path, columns)
        with filesystem.open_input_file(str(path)) as source:
            return _read_table(source, path, columns)
    except (OSError, pa.ArrowInvalid) as e:
        raise FormatError(f"cannot read shard {path}: {e}; `capture shards verify` checks the whole run") from None


def _read_table(source, path, columns):
    schema = pa.ipc.open_stream(source).schema
    read_header(schema)
    if columns is None:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()
    missing = [c for c in columns if c not in schema.names]
    if not columns or missing:
        raise FormatError(f"{path}: no column(s) {missing or columns} (it has {', '.join(schema.names)})")
    if any(schema.field(c).type == pa.large_binary() for c in columns) and "num_tokens" not in columns:
        columns = [*columns, "num_tokens"]  # a state cell decodes with its row's token count
    options = pa.ipc.IpcReadOptions(included_fields=[schema.get_field_index(c) for c in columns])
    source.seek(0)
    return pa.ipc.open_stream(source, options=options).read_all()


def shard_paths(run_dir: str | os.PathLike) -> list[Path]:
    """Committed shards of a run, in manifest order."""
    run_dir = Path(run_dir)
    return [run_dir / s["path"] for s in manifest_mod.read(run_dir).shards]


def state_tensor(table: pa.Table, column: str, row: int) -> torch.Tensor:
    """States of ``column`` for ``row``: a ``[T, H]`` tensor of the recorded dtype (bf16 or fp16), decoded
    by the recorded codec (:mod:`shards.codecs`). ``table`` must include ``num_tokens``."""
    field = table.schema.field(column)
    meta = field.metadata
    hidden = int(meta[b"shape"].decode().strip("[]").split(",")[1])
    if "num_tokens" not in table.column_names:
        raise FormatError(f"decoding {column} needs the num_tokens column; read it too")
    tokens = table.column("num_tokens")[row].as_py()
    cell = table.column(column)[row].as_buffer()
    return codecs.decode(meta[b"codec"].decode(), cell, tokens, hidden, DTYPES[meta[b"dtype"].decode()])


def iter_rows(run_dir: str | os.PathLike) -> Iterator[dict]:
    """Every committed row as a dict: ids, mask and argmax as numpy arrays, states as tensors,
    ``finish_reasons`` as a list of strings (None in dataset mode)."""
    for path in shard_paths(run_dir):
        table = read_table(path)
        state_cols = [f.name for f in table.schema if f.type == pa.large_binary()]
        scalars = [c for c in table.column_names if c not in state_cols]
        for i in range(table.num_rows):
            row = {}
            for c in scalars:
                value = table.column(c)[i]
                numeric = isinstance(value, pa.ListScalar) and not pa.types.is_string(value.type.value_type)
                if numeric and value.is_valid:
                    row[c] = value.values.to_numpy(zero_copy_only=False)
                else:  # scalars, finish_reasons (a list of strings or None)
                    row[c] = value.as_py()
            for c in state_cols:
                row[c] = state_tensor(table, c, i)
            yield row
