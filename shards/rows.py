"""One stored row both ways: :func:`record_batch` encodes :class:`Row`\\ s into an Arrow record batch and
:func:`read_row` decodes a row of a shard table back into the same :class:`Row` (its declared inverse:
``read_row(record_batch(schema, rows), i) == rows[i]``, bit for bit for lossless codecs; tested).

Every reader decodes rows here: the stream (:mod:`shards.stream`), recode, ``shards head``, export and
Ray Data. A state cell alone decodes with :func:`state_tensor`; a row's top-K cells with :func:`topk_arrays`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import torch
import zstandard

from shards import codecs
from shards import topk as topk_mod
from shards.format import METADATA_KEY, STATE_TYPE, FormatError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Row:
    """One conversation as stored. Arrays: ``input_ids`` int32 ``[T]``, ``loss_mask`` bool ``[T]``,
    ``argmax`` int32 ``[T]`` or None, ``states`` column → ``[T, H]`` tensor (bf16 or fp16);
    ``finish_reasons``: one ``"stop"``/``"length"`` per generated turn (regenerate mode), else None;
    ``topk_ids`` int32 ``[T, K]`` and ``topk_logprobs`` float32 ``[T, K]`` (``--topk K`` runs; else None):
    the target's K most likely next tokens at each position, descending (:mod:`shards.topk`)."""

    sample_id: str
    source: str
    row_index: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    argmax: np.ndarray | None
    states: dict[str, torch.Tensor]
    token_sha256: str
    finish_reasons: tuple[str, ...] | None = None
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to_dict(self) -> dict:
        """Flat view, one key per shard column: ids, mask, argmax and the top-K arrays as numpy arrays
        (argmax and top-K only when stored), states under their column names, ``num_tokens`` /
        ``num_loss_tokens``, ``finish_reasons`` as a list of strings or None."""
        out = {"sample_id": self.sample_id, "source": self.source, "row_index": self.row_index,
               "input_ids": self.input_ids, "loss_mask": self.loss_mask, "num_tokens": self.num_tokens,
               "num_loss_tokens": self.num_loss_tokens, "token_sha256": self.token_sha256,
               "finish_reasons": None if self.finish_reasons is None else list(self.finish_reasons)}
        if self.argmax is not None:
            out["argmax"] = self.argmax
        if self.topk_ids is not None:
            out[topk_mod.IDS], out[topk_mod.LOGPROBS] = self.topk_ids, self.topk_logprobs
        return out | self.states


def _list_array(arrays: Sequence[np.ndarray], value_type: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = pa.array(np.concatenate(arrays) if arrays else np.zeros(0), type=value_type)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def record_batch(schema: pa.Schema, rows: Sequence[Row], encode: Callable | None = None) -> pa.RecordBatch:
    """Rows → one Arrow record batch with ``schema``'s columns (:func:`shards.format.schema`). ``encode``
    maps a list of ``[T, H]`` tensors to their cells (default: the run codec, one thread). Raises
    ValueError for a row whose top-K arrays are missing or not ``[T, K]`` when the schema has them."""
    head = json.loads(schema.metadata[METADATA_KEY])
    codec, check, version = head["codec"], cell_check(schema), head.get("format_version")
    encode = encode or (lambda tensors: [codecs.encode(codec, t, check=check, format_version=version) for t in tensors])
    cols: dict[str, pa.Array] = {
        "sample_id": pa.array([r.sample_id for r in rows], pa.string()),
        "source": pa.array([r.source for r in rows], pa.string()),
        "row_index": pa.array([r.row_index for r in rows], pa.int64()),
        "input_ids": _list_array([r.input_ids for r in rows], pa.int32()),
        "loss_mask": _list_array([r.loss_mask for r in rows], pa.bool_()),
        "num_tokens": pa.array([r.num_tokens for r in rows], pa.int32()),
        "num_loss_tokens": pa.array([r.num_loss_tokens for r in rows], pa.int32()),
        "token_sha256": pa.array([r.token_sha256 for r in rows], pa.string()),
    }
    if "argmax" in schema.names:
        cols["argmax"] = _list_array([r.argmax for r in rows], pa.int32())
    if topk_mod.IDS in schema.names:
        k = json.loads(schema.metadata[METADATA_KEY])["topk"]
        for r in rows:
            if r.topk_ids is None or r.topk_logprobs is None or r.topk_ids.shape != (r.num_tokens, k) \
                    or r.topk_logprobs.shape != (r.num_tokens, k):
                shapes = [None if a is None else a.shape for a in (r.topk_ids, r.topk_logprobs)]
                raise ValueError(f"{r.sample_id}: top-K arrays {shapes}, expected ({r.num_tokens}, {k}) each")
        cols[topk_mod.IDS] = pa.array([topk_mod.encode_ids(r.topk_ids) for r in rows], topk_mod.TYPE)
        cols[topk_mod.LOGPROBS] = pa.array([topk_mod.encode_logprobs(r.topk_logprobs) for r in rows], topk_mod.TYPE)
    if "finish_reasons" in schema.names:
        reasons = [None if r.finish_reasons is None else list(r.finish_reasons) for r in rows]
        cols["finish_reasons"] = pa.array(reasons, pa.list_(pa.string()))
    for name in schema.names:
        if schema.field(name).type == STATE_TYPE:
            cols[name] = pa.array(encode([r.states[name] for r in rows]), type=STATE_TYPE)
    return pa.RecordBatch.from_arrays([cols[n] for n in schema.names], schema=schema)


def cell_check(schema: pa.Schema) -> str | None:
    """The checksum this schema's state cells end with (its state fields' ``check``: ``xxh3_64`` from
    format 1.4, ``crc32`` in 1.3), or None."""
    checks = {(f.metadata or {}).get(b"check") for f in schema if f.type == STATE_TYPE}
    check = next(iter(checks - {None}), None)
    return check.decode() if check else None


def state_columns(table: pa.Table | pa.RecordBatch) -> list[str]:
    """The state columns (``tap_<k>``, ``final``) a table holds, in schema order."""
    return [f.name for f in table.schema if f.type == STATE_TYPE]


def state_tensor(table: pa.Table | pa.RecordBatch, column: str, row: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """States of ``column`` for ``row``: a ``[T, H]`` tensor of the recorded dtype (bf16 or fp16), decoded
    by the recorded codec (:mod:`shards.codecs`) straight from the Arrow buffer (no widening to float32,
    no per-element Python); written into ``out`` when given (e.g. ``sample[:, l]`` of a ``[T, L, H]``
    sample, :func:`shards.codecs.decode`). ``table`` must include ``num_tokens``. Raises FormatError without it,
    ValueError for a cell that does not decode to ``[T, H]``, and FormatError for a damaged cell (its
    checksum, format 1.3 on, or a zstd frame's checksum, 1.2 on, fails)."""
    meta = table.schema.field(column).metadata
    hidden = int(meta[b"shape"].decode().strip("[]").split(",")[1])
    if "num_tokens" not in table.column_names:
        raise FormatError(f"decoding {column} needs the num_tokens column; read it too")
    tokens = table.column("num_tokens")[row].as_py()
    cell = table.column(column)[row].as_buffer()
    try:
        return codecs.decode(meta[b"codec"].decode(), cell, tokens, hidden, DTYPES[meta[b"dtype"].decode()],
                             check=meta[b"check"].decode() if b"check" in meta else None, out=out)
    except (codecs.CellError, zstandard.ZstdError) as e:  # the cell's checksum (1.3 on), a frame's checksum (1.2)
        raise FormatError(f"{column} of row {row} does not decode ({e}): the shard is damaged; "
                          "`capture shards verify` names the file") from None


def topk_arrays(table: pa.Table | pa.RecordBatch, row: int, k: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """The top-K cells of ``row``: (int32 ``[T, K]`` ids, float32 ``[T, K]`` log-probabilities), or None
    when the table has no top-K columns. ``k``: K (default: the ``topk_ids`` field's metadata, else the
    run header in the schema metadata). T is the row's token count (from ``input_ids``). Raises
    ValueError for a cell that does not decode to ``[T, K]``."""
    if topk_mod.IDS not in table.column_names:
        return None
    if k is None:
        meta = table.schema.field(topk_mod.IDS).metadata or {}
        if b"k" in meta:
            k = int(meta[b"k"])
        else:
            k = int(json.loads((table.schema.metadata or {})[METADATA_KEY])["topk"])
    tokens = len(table.column("input_ids")[row].values) if "input_ids" in table.column_names else None
    ids = topk_mod.decode_ids(table.column(topk_mod.IDS)[row].as_buffer(), k, tokens)
    values = topk_mod.decode_logprobs(table.column(topk_mod.LOGPROBS)[row].as_buffer(), k, tokens)
    return ids, values


def with_num_tokens(table: pa.Table | pa.RecordBatch) -> pa.Table | pa.RecordBatch:
    """``table`` with its ``num_tokens`` column (recomputed from ``input_ids`` where it is missing, e.g. a
    Ray Data batch): what :func:`state_tensor` needs."""
    if "num_tokens" in table.column_names:
        return table
    import pyarrow.compute as pc

    table = pa.table(table) if isinstance(table, pa.RecordBatch) else table
    return table.append_column("num_tokens", pc.list_value_length(table.column("input_ids")).cast(pa.int32()))


def read_row(table: pa.Table | pa.RecordBatch, i: int, states: Sequence[str] | None = None, topk: bool = True) -> Row:
    """Row ``i`` of a shard table as the :class:`Row` :func:`record_batch` was given: ids int32, mask
    bool and argmax int32 (None when not stored) as numpy arrays, ``states`` decoded by
    :func:`state_tensor` (default every state column the table holds; ``[]`` none), finish reasons a
    tuple or None (also for shards from before the column existed), the top-K arrays by
    :func:`topk_arrays` (None when not stored, or not asked for: ``topk=False``). ``num_tokens`` is recomputed from the ids, so a table
    without that column decodes too (e.g. a Ray Data batch)."""
    if states is None or states:
        table = with_num_tokens(table)

    def values(name: str, dtype) -> np.ndarray:
        return table.column(name)[i].values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)

    names = table.column_names
    reasons = table.column("finish_reasons")[i].as_py() if "finish_reasons" in names else None
    top = topk_arrays(table, i) if topk else None
    return Row(
        sample_id=table.column("sample_id")[i].as_py(),
        source=table.column("source")[i].as_py(),
        row_index=table.column("row_index")[i].as_py(),
        input_ids=values("input_ids", np.int32),
        loss_mask=values("loss_mask", np.bool_),
        argmax=values("argmax", np.int32) if "argmax" in names else None,
        states={c: state_tensor(table, c, i) for c in (state_columns(table) if states is None else states)},
        token_sha256=table.column("token_sha256")[i].as_py(),
        finish_reasons=None if reasons is None else tuple(reasons),
        topk_ids=None if top is None else top[0],
        topk_logprobs=None if top is None else top[1],
    )
