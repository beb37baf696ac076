"""Read shards: whole tables (memory-mapped), rows, and states as bf16 tensors without copies.

A state cell is the raw bytes of a ``[T, H]`` tensor (see :mod:`shards.format`); :func:`state_tensor`
wraps those bytes in a torch tensor of the recorded dtype with no per-element Python and no widening.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import torch

from shards import manifest as manifest_mod
from shards.format import FormatError, read_header

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def read_table(path: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """All record batches of one shard, or only ``columns`` (the others are neither read into memory nor
    decompressed). Raises FormatError for an unknown format version."""
    with pa.memory_map(str(path)) as source:
        schema = pa.ipc.open_stream(source).schema
        read_header(schema)
        if columns is None:
            source.seek(0)
            return pa.ipc.open_stream(source).read_all()
        missing = [c for c in columns if c not in schema.names]
        if not columns or missing:
            raise FormatError(f"{path}: no column(s) {missing or columns} (it has {', '.join(schema.names)})")
        options = pa.ipc.IpcReadOptions(included_fields=[schema.get_field_index(c) for c in columns])
        source.seek(0)
        return pa.ipc.open_stream(source, options=options).read_all()


def shard_paths(run_dir: str | os.PathLike) -> list[Path]:
    """Committed shards of a run, in manifest order."""
    run_dir = Path(run_dir)
    return [run_dir / s["path"] for s in manifest_mod.read(run_dir).shards]


def state_tensor(table: pa.Table, column: str, row: int) -> torch.Tensor:
    """States of ``column`` for ``row`` as a ``[T, H]`` tensor (bf16 or fp16, as recorded), zero-copy."""
    field = table.schema.field(column)
    hidden = int(field.metadata[b"shape"].decode().strip("[]").split(",")[1])
    dtype = DTYPES[field.metadata[b"dtype"].decode()]
    buf = table.column(column)[row].as_buffer()
    with warnings.catch_warnings():  # Arrow buffers are read-only; torch warns but never writes here
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(np.frombuffer(buf, dtype=np.int16))
    return flat.view(dtype).view(-1, hidden)


def iter_rows(run_dir: str | os.PathLike) -> Iterator[dict]:
    """Every committed row as a dict: ids, mask and argmax as numpy arrays, states as tensors."""
    for path in shard_paths(run_dir):
        table = read_table(path)
        state_cols = [f.name for f in table.schema if f.type == pa.large_binary()]
        scalars = [c for c in table.column_names if c not in state_cols]
        for i in range(table.num_rows):
            row = {}
            for c in scalars:
                value = table.column(c)[i]
                row[c] = value.values.to_numpy(zero_copy_only=False) if isinstance(value, pa.ListScalar) else value.as_py()
            for c in state_cols:
                row[c] = state_tensor(table, c, i)
            yield row
