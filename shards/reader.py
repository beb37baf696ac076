"""Read a run's committed shards: whole tables and decoded rows, for tools and tests.

Training reads through :class:`shards.stream.ShardStream`; these helpers walk a run in manifest order.
Rows are decoded by :func:`shards.rows.read_row`; tables are opened by
:meth:`shards.run.Location.read_table` (local shards memory-mapped).
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath
from typing import Iterator

import pyarrow as pa

from shards import manifest as manifest_mod
from shards.rows import read_row
from shards.run import Location, as_location


def read_table(path: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """One shard file (a local path or a URI) as a table, or only ``columns`` (``num_tokens`` comes along
    with any state column). Raises FormatError for an unreadable shard, an unknown format version or an
    unknown column."""
    folder, _, name = os.fspath(path).rpartition("/")
    return as_location(folder or ".").read_table(name, columns)


def shard_paths(run: str | os.PathLike | Location) -> list[PurePosixPath]:
    """Paths of the committed shards of a run, in manifest order (on the run's file system)."""
    loc = as_location(run)
    return [PurePosixPath(loc.join(s["path"])) for s in manifest_mod.read(loc).shards]


def iter_rows(run: str | os.PathLike | Location) -> Iterator[dict]:
    """Every committed row, in manifest order, as :meth:`shards.rows.Row.to_dict` (ids, mask and argmax
    numpy arrays, states ``[T, H]`` tensors under their column names)."""
    loc = as_location(run)
    for shard in manifest_mod.read(loc).shards:
        table = loc.read_table(shard["path"], rows=shard["rows"])
        for i in range(table.num_rows):
            yield read_row(table, i).to_dict()
