"""Write shards atomically: temporary name → fsync → rename → (the caller appends the manifest line).

A :class:`ShardWriter` belongs to one engine replica. Each shard goes to ``.tmp-<name>`` while it grows;
once it reaches the target size (or on :meth:`ShardWriter.close`) the Arrow stream is finished, the
file fsynced and renamed to a name no other writer can pick (``shard-<utc time>-<random>.arrow``), and
the directory fsynced. The SHA-256 is computed from the bytes as they are written. The shard is still
uncommitted: it becomes part of the run only when the driver appends its :class:`ShardInfo` to the
manifest (:mod:`shards.manifest`); a file no manifest line names is garbage (``capture shards gc``).

Outside a local folder (an object store, see :mod:`shards.run`) there is no rename and no fsync: the shard
is streamed straight to its final unique name, hashed as it is written, and the object exists only once
its stream is closed; a shard aborted mid-write is deleted (best effort; a leftover is garbage as above).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute in payload()
import torch

from shards.format import layout_of_schema
from shards.rows import Row, record_batch
from shards.run import Location, ShardSink, as_location


OPTIONS = pa.ipc.IpcWriteOptions(compression=None)  # cells are compressed by the codec, not by Arrow


class CellEncoder:
    """``[T, H]`` tensors → cells in the layout of the run header in ``schema``
    (:func:`shards.format.layout_of_schema`: codec, cell checksum, int4 packing of the version that started
    the run), on ``threads`` threads (zstd and numpy release the GIL)."""

    def __init__(self, schema: pa.Schema, threads: int = 1):
        self.layout = layout_of_schema(schema)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="encode") if threads > 1 else None

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[bytes]:
        encode = self.layout.encode
        return [encode(t) for t in tensors] if self.pool is None else list(self.pool.map(encode, tensors))

    def close(self) -> None:
        """End the encoder threads (the encoder is unusable after)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What the manifest records of one shard (``path`` is relative to the run folder)."""

    path: str
    rows: int
    tokens: int
    loss_tokens: int
    bytes: int
    sha256: str
    sample_ids: tuple[str, ...]
    token_sha256: tuple[str, ...]


class ShardWriter:
    """Appends rows to size-bounded shards in the run ``out`` (a path, a URI or a Location). Not
    thread-safe; one per replica.

    ``target_bytes``: a shard is closed once its size on disk reaches this many bytes.
    ``threads``: cells are encoded by a pool of this many threads (zstd and numpy release the GIL).
    Raises OSError (e.g. ENOSPC) from the file system; the temporary file is removed first.
    """

    def __init__(self, out: str | os.PathLike | Location, schema: pa.Schema, target_bytes: int, threads: int = 1):
        self.location = as_location(out)
        self.schema = schema
        self.target_bytes = target_bytes
        self.encode = CellEncoder(schema, threads)
        self.options = OPTIONS
        self._open: tuple[ShardSink, pa.ipc.RecordBatchStreamWriter] | None = None
        self._rows: list[tuple[str, str, int, int]] = []  # sample_id, token_sha256, tokens, loss tokens

    def write(self, rows: Sequence[Row], batch: pa.RecordBatch | None = None) -> list[ShardInfo]:
        """Append ``rows`` as one record batch (``batch``: those rows already encoded, e.g. by a
        :class:`TeeWriter`); returns the shards this call closed (maybe none)."""
        if not rows:
            return []
        try:
            if self._open is None:
                name = f"shard-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:12]}.arrow"
                sink = self.location.open_shard(name)
                self._open = (sink, pa.ipc.new_stream(sink, self.schema, options=self.options))
            self._open[1].write_batch(batch if batch is not None else record_batch(self.schema, rows, self.encode))
        except BaseException:
            self.abort()
            raise
        self._rows += [(r.sample_id, r.token_sha256, r.num_tokens, r.num_loss_tokens) for r in rows]
        return self.close() if self._open[0].size >= self.target_bytes else []

    def close(self) -> list[ShardInfo]:
        """Finish the open shard (if any): end the stream and make it visible under its name
        (:meth:`shards.run.ShardSink.finish`). Returns its info."""
        if self._open is None:
            return []
        sink, stream = self._open
        try:
            stream.close()
            sink.finish()
        except BaseException:
            self.abort()
            raise
        info = ShardInfo(
            path=sink.name,
            rows=len(self._rows),
            tokens=sum(r[2] for r in self._rows),
            loss_tokens=sum(r[3] for r in self._rows),
            bytes=sink.size,
            sha256=sink.sha.hexdigest(),
            sample_ids=tuple(r[0] for r in self._rows),
            token_sha256=tuple(r[1] for r in self._rows),
        )
        self._open, self._rows = None, []
        return [info]

    def abort(self) -> None:
        """Drop the open shard and its temporary file or object (nothing of it was committed)."""
        if self._open is None:
            return
        sink, _ = self._open
        self._open, self._rows = None, []
        sink.abort()


def payload(table: pa.Table) -> tuple[ShardInfo, np.ndarray]:
    """``table`` (shard rows, the run's schema) as one online payload: ``(ShardInfo with path "",
    uint8 array of one Arrow IPC stream)``; ``bytes``/``sha256`` describe the stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=OPTIONS) as stream:
        stream.write_table(table)
    buf = sink.getvalue()
    info = ShardInfo(path="", rows=table.num_rows, tokens=int(pa.compute.sum(table["num_tokens"]).as_py() or 0),
                     loss_tokens=int(pa.compute.sum(table["num_loss_tokens"]).as_py() or 0), bytes=buf.size,
                     sha256=hashlib.sha256(buf).hexdigest(), sample_ids=tuple(table["sample_id"].to_pylist()),
                     token_sha256=tuple(table["token_sha256"].to_pylist()))
    return info, np.frombuffer(buf, dtype=np.uint8)


class StreamWriter:
    """The payload side of an online run (:mod:`capture.online`): rows encoded exactly as shard rows (same
    schema, codec and cell checks) into one in-memory Arrow IPC stream per work unit, handed out by
    :meth:`close_payload` as ``(ShardInfo with path "", payload)``; ``payload`` is a read-only uint8 numpy
    array over the stream's bytes, ``bytes``/``sha256`` in the info describe it. Writes no shard
    (:meth:`close` closes none; :class:`TeeWriter` writes both). Not thread-safe; one per replica."""

    def __init__(self, schema: pa.Schema, threads: int = 1):
        self.encode = CellEncoder(schema, threads)
        self.schema = schema
        self._batches: list[pa.RecordBatch] = []

    def write(self, rows: Sequence[Row], batch: pa.RecordBatch | None = None) -> list:
        """Add ``rows`` (``batch``: already encoded) to the open payload; closes no shard (returns [])."""
        if rows:
            self._batches.append(batch if batch is not None else record_batch(self.schema, rows, self.encode))
        return []

    def close(self) -> list:
        """No shard to close: ``[]``."""
        return []

    def close_payload(self) -> list:
        """``[(ShardInfo, payload)]`` for the rows written since the last call (``[]`` when none)."""
        if not self._batches:
            return []
        out = payload(pa.Table.from_batches(self._batches, self.schema))
        self._batches = []
        return [out]

    def abort(self) -> None:
        self._batches = []


class TeeWriter:
    """Shards and payloads of the same rows (an online run with ``keep``): each batch is encoded once,
    appended to the open shard (:class:`ShardWriter`, closing and committing as in ``capture run``) and
    to the unit's payload (:class:`StreamWriter`)."""

    def __init__(self, shards: ShardWriter, payloads: StreamWriter):
        self.shards, self.payloads = shards, payloads

    def write(self, rows: Sequence[Row]) -> list[ShardInfo]:
        if not rows:
            return []
        batch = record_batch(self.shards.schema, rows, self.shards.encode)
        self.payloads.write(rows, batch)
        return self.shards.write(rows, batch)

    def close(self) -> list[ShardInfo]:
        return self.shards.close()

    def close_payload(self) -> list:
        return self.payloads.close_payload()

    def abort(self) -> None:
        self.shards.abort()
        self.payloads.abort()
