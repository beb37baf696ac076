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


class SampleIndex:
    """Random access to a run's committed rows by sample id, for trainers that read a run in place
    (:mod:`shards.speculators`, :mod:`shards.specforge`): the manifest maps ids to (shard, row) once; the
    last ``open_shards`` tables stay open (local: memory-mapped). One per process (DataLoader workers each
    make their own on first use). Raises CaptureError when the run lacks one of ``sample_ids``."""

    def __init__(self, run: str | os.PathLike | Location, sample_ids, open_shards: int = 4):
        from collections import OrderedDict

        from common.errors import CaptureError

        self.location = as_location(run)
        self.where = {sid: (s["path"], r) for s in manifest_mod.read(self.location).shards
                      for r, sid in enumerate(s["sample_ids"])}
        missing = [sid for sid in sample_ids if sid not in self.where]
        if missing:
            raise CaptureError(f"the run {self.location.path} no longer holds {len(missing)} sample(s) of this index, "
                               f"e.g. {missing[0]}; export the index again")
        self.open_shards, self.tables = open_shards, OrderedDict()

    def row(self, sample_id: str) -> tuple[pa.Table, int]:
        """The shard table holding ``sample_id`` and its row."""
        path, row = self.where[sample_id]
        if path not in self.tables:
            self.tables[path] = self.location.read_table(path)
            while len(self.tables) > self.open_shards:
                self.tables.popitem(last=False)
        self.tables.move_to_end(path)
        return self.tables[path], row
