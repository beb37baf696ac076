"""Write shards atomically: temporary name → fsync → rename → (the caller appends the manifest line).

A :class:`ShardWriter` belongs to one engine replica. Each shard goes to ``.tmp-<name>`` while it grows;
once it reaches the target size (or on :meth:`ShardWriter.close`) the Arrow stream is finished, the
file fsynced and renamed to a name no other writer can pick (``shard-<utc time>-<random>.arrow``), and
the directory fsynced. The SHA-256 is computed from the bytes as they are written. The shard is still
uncommitted: it becomes part of the run only when the driver appends its :class:`ShardInfo` to the
manifest (:mod:`shards.manifest`); a file no manifest line names is garbage (``capture shards gc``).

Outside a local folder (an object store, see :mod:`shards.fs`) there is no rename and no fsync: the shard
is streamed straight to its final unique name, hashed as it is written, and the object exists only once
its stream is closed; a shard aborted mid-write is deleted (best effort; a leftover is garbage as above).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import torch

from shards import codecs
from shards.fs import Location, as_location
from shards.format import METADATA_KEY, STATE_TYPE

TMP_PREFIX = ".tmp-"


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


@dataclasses.dataclass(frozen=True)
class Row:
    """One conversation ready to store. Arrays: ``input_ids`` int32 ``[T]``, ``loss_mask`` bool ``[T]``,
    ``argmax`` int32 ``[T]`` or None, ``states`` column → ``[T, H]`` tensor (bf16 or fp16);
    ``finish_reasons``: one ``"stop"``/``"length"`` per generated turn (regenerate mode), else None."""

    sample_id: str
    source: str
    row_index: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    argmax: np.ndarray | None
    states: dict[str, torch.Tensor]
    token_sha256: str
    finish_reasons: tuple[str, ...] | None = None


def _list_array(arrays: Sequence[np.ndarray], value_type: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = pa.array(np.concatenate(arrays) if arrays else np.zeros(0), type=value_type)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _state_array(cells: Sequence[bytes]) -> pa.Array:
    return pa.array(cells, type=STATE_TYPE)


def record_batch(schema: pa.Schema, rows: Sequence[Row], encode: Callable = None) -> pa.RecordBatch:
    """Rows → one Arrow record batch with ``schema``'s columns. ``encode`` maps a list of ``[T, H]``
    tensors to their cells (default: the run codec, one thread)."""
    codec = json.loads(schema.metadata[METADATA_KEY])["codec"]
    encode = encode or (lambda tensors: [codecs.encode(codec, t) for t in tensors])
    cols: dict[str, pa.Array] = {
        "sample_id": pa.array([r.sample_id for r in rows], pa.string()),
        "source": pa.array([r.source for r in rows], pa.string()),
        "row_index": pa.array([r.row_index for r in rows], pa.int64()),
        "input_ids": _list_array([r.input_ids for r in rows], pa.int32()),
        "loss_mask": _list_array([r.loss_mask for r in rows], pa.bool_()),
        "num_tokens": pa.array([len(r.input_ids) for r in rows], pa.int32()),
        "num_loss_tokens": pa.array([int(r.loss_mask.sum()) for r in rows], pa.int32()),
        "token_sha256": pa.array([r.token_sha256 for r in rows], pa.string()),
    }
    if "argmax" in schema.names:
        cols["argmax"] = _list_array([r.argmax for r in rows], pa.int32())
    if "finish_reasons" in schema.names:
        reasons = [None if r.finish_reasons is None else list(r.finish_reasons) for r in rows]
        cols["finish_reasons"] = pa.array(reasons, pa.list_(pa.string()))
    for name in schema.names:
        if schema.field(name).type == STATE_TYPE:
            cols[name] = _state_array(encode([r.states[name] for r in rows]))
    return pa.RecordBatch.from_arrays([cols[n] for n in schema.names], schema=schema)


class _HashingFile:
    """File-like sink that hashes and counts what pyarrow writes through it."""

    def __init__(self, file):
        self.file = file
        self.sha = hashlib.sha256()
        self.size = 0
        self.closed = False

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(memoryview(data))
        return self.file.write(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.closed = True


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter:
    """Appends rows to size-bounded shards in ``out_dir``. Not thread-safe; one per replica.

    ``target_bytes``: a shard is closed once its size on disk reaches this many bytes.
    ``threads``: cells are encoded by a pool of this many threads (zstd and numpy release the GIL).
    Raises OSError (e.g. ENOSPC) from the file system; the temporary file is removed first.
    """

    def __init__(self, out_dir: str | os.PathLike | Location, schema: pa.Schema, target_bytes: int, threads: int = 1):
        self.location = as_location(out_dir)
        self.out_dir = Path(self.location.path)
        self.schema = schema
        self.target_bytes = target_bytes
        self.codec = json.loads(schema.metadata[METADATA_KEY])["codec"]
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="encode") if threads > 1 else None
        self.options = pa.ipc.IpcWriteOptions(compression=None)
        self._open: tuple[str, _HashingFile, pa.ipc.RecordBatchStreamWriter] | None = None
        self._rows: list[tuple[str, str, int, int]] = []  # sample_id, token_sha256, tokens, loss tokens

    def write(self, rows: Sequence[Row]) -> list[ShardInfo]:
        """Append ``rows`` as one record batch; returns the shards this call closed (maybe none)."""
        if not rows:
            return []
        try:
            if self._open is None:
                name = f"shard-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:12]}.arrow"
                if self.location.local:
                    sink = _HashingFile(open(self.out_dir / (TMP_PREFIX + name), "xb"))  # never overwrite
                else:  # an object store: the final name at once; the object appears on close
                    sink = _HashingFile(self.location.filesystem.open_output_stream(self.location.join(name)))
                self._open = (name, sink, pa.ipc.new_stream(sink, self.schema, options=self.options))
            self._open[2].write_batch(record_batch(self.schema, rows, self._encode))
        except BaseException:
            self.abort()
            raise
        self._rows += [(r.sample_id, r.token_sha256, len(r.input_ids), int(r.loss_mask.sum())) for r in rows]
        return self.close() if self._open[1].size >= self.target_bytes else []

    def _encode(self, tensors: Sequence[torch.Tensor]) -> list[bytes]:
        if self.pool is None:
            return [codecs.encode(self.codec, t) for t in tensors]
        return list(self.pool.map(lambda t: codecs.encode(self.codec, t), tensors))

    def close(self) -> list[ShardInfo]:
        """Finish the open shard (if any): end the stream, fsync, rename (object store: close the
        object). Returns its info."""
        if self._open is None:
            return []
        name, sink, stream = self._open
        try:
            stream.close()
            if self.location.local:
                sink.file.flush()
                os.fsync(sink.file.fileno())
                sink.file.close()
                os.rename(self.out_dir / (TMP_PREFIX + name), self.out_dir / name)
                fsync_dir(self.out_dir)
            else:
                sink.file.close()
        except BaseException:
            self.abort()
            raise
        info = ShardInfo(
            path=name,
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
        name, sink, _ = self._open
        self._open, self._rows = None, []
        try:
            sink.file.close()  # flushing the buffer can raise ENOSPC again: the file goes anyway
        except OSError:
            pass
        finally:
            if self.location.local:
                (self.out_dir / (TMP_PREFIX + name)).unlink(missing_ok=True)
            else:
                try:
                    self.location.delete(name)
                except OSError:
                    pass  # the store is failing: the object, if any, stays as garbage
