"""A Ray Data datasource over a run: ``read_run(run)`` → ``ray.data.Dataset``, one read task per shard.

Blocks are the committed shards' Arrow tables as stored (manifest order), with the rows outside
``split`` removed (:func:`shards.stream.in_split`): ``sample_id``, ``source``, ids, mask, argmax as
list columns, each state column an encoded ``[T, H]`` cell (``large_binary``, the run's codec; its
field metadata travels with the block schema), and a ``--topk K`` run's ``topk_ids`` / ``topk_logprobs``
encoded ``[T, K]`` cells (``binary``, :mod:`shards.topk`). States stay encoded inside Ray Data because numpy, Ray
Data's batch format, has no bfloat16; :func:`samples` decodes a ``pyarrow`` batch into the sample dicts of
:class:`shards.stream.ShardStream` (bf16 tensors straight from the Arrow buffers), e.g.::

    ds = read_run("runs/a", split="train")
    for table in ds.iter_batches(batch_format="pyarrow", batch_size=8):
        for sample in samples(table, header):   # header = shards.manifest.read("runs/a").header
            ...

``run``: a path, a URI or a :class:`shards.run.Location` (a read task on an object store fetches its
shard whole).
"""

from __future__ import annotations

import functools
import os

import pyarrow as pa
from ray.data import Dataset, Datasource, ReadTask, read_datasource
from ray.data.block import BlockMetadata

from common.errors import CaptureError
from shards import manifest as manifest_mod
from shards.format import RunHeader
from shards.rows import table_sample
from shards.run import Location, as_location
from shards.stream import SPLITS, in_split


class ShardDatasource(Datasource):
    """The committed shards of ``run`` (a snapshot of the manifest taken here). Raises CaptureError when
    ``run`` holds no capture run or ``split`` is unknown."""

    def __init__(self, run: str | os.PathLike | Location, *, split: str = "all", heldout_fraction: float = 0.01):
        if split not in SPLITS:
            raise CaptureError(f"unknown split {split!r}; one of {', '.join(SPLITS)}")
        self.location = as_location(run)
        manifest = manifest_mod.read(self.location)
        if manifest.header is None:
            raise CaptureError(f"{run} holds no capture run")
        self.shards = list(manifest.shards)
        self.split, self.heldout_fraction = split, heldout_fraction

    def estimate_inmemory_data_size(self) -> int:
        return sum(int(s["bytes"]) for s in self.shards)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        tasks = []
        for shard in self.shards:
            meta = BlockMetadata(num_rows=shard["rows"] if self.split == "all" else None, size_bytes=int(shard["bytes"]),
                                 exec_stats=None, input_files=(shard["path"],))
            read = functools.partial(_read_shard, self.location, shard["path"], self.split, self.heldout_fraction)
            tasks.append(ReadTask(read, meta, per_task_row_limit=per_task_row_limit))
        return tasks


def _read_shard(location: Location, path: str, split: str, heldout_fraction: float) -> list[pa.Table]:
    table = location.read_table(path)
    if split != "all":
        keep = [in_split(s, split, heldout_fraction) for s in table.column("sample_id").to_pylist()]
        table = table.filter(pa.array(keep, pa.bool_()))
    return [table]


def read_run(run: str | os.PathLike | Location, *, split: str = "all", heldout_fraction: float = 0.01) -> Dataset:
    """``ray.data.read_datasource`` of :class:`ShardDatasource` (a running Ray, or a local one started)."""
    return read_datasource(ShardDatasource(run, split=split, heldout_fraction=heldout_fraction))


def samples(table: pa.Table, header: RunHeader) -> list[dict]:
    """A ``pyarrow`` batch of :func:`read_run` as :class:`shards.stream.ShardStream` sample dicts: ids
    int64 ``[T]``, mask bool ``[T]``, argmax int64 ``[T]``, taps bf16 ``[T, L, H]``, final ``[T, H]``,
    ``topk_ids`` int64 / ``topk_logprobs`` float32 ``[T, K]`` (``--topk`` runs): every tap and state
    ``header`` names, decoded by :func:`shards.rows.table_sample` in the layout of the batch's own header
    (Ray Data keeps the schema metadata)."""
    columns = header.layout.columns_for()
    return [table_sample(table, i, columns, header.topk) for i in range(table.num_rows)]
