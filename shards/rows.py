"""One stored row both ways: :func:`record_batch` encodes :class:`Row`\\ s into an Arrow record batch and
:func:`read_row` decodes a row of a shard table back into the same :class:`Row` (its declared inverse:
``read_row(record_batch(schema, rows), i) == rows[i]``, bit for bit for lossless codecs; tested).

Every reader decodes rows here, with the cell layout of the run's header (:class:`shards.format.CellLayout`):
recode, ``shards head`` and the tools by :func:`read_row`; the training samples (the contract of
:mod:`shards.stream`: ``ShardStream``, ``OnlineStream``, the HF ``datasets`` transform, export, Ray Data) by
the one sample decoder :func:`decode_sample` (over a shard table: :func:`table_sample`). A state cell alone
decodes with :func:`state_tensor`; a row's top-K cells with :func:`topk_arrays`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import torch
import zstandard

from shards import codecs
from shards import topk as topk_mod
from shards.format import FINAL, STATE_TYPE, CellLayout, FormatError, layout_of_schema, tap_layer


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
    """Rows → one Arrow record batch with ``schema``'s columns (:func:`shards.format.schema`), its state
    cells in the layout of the header in ``schema`` (:func:`shards.format.layout_of_schema`). ``encode``
    maps a list of ``[T, H]`` tensors to their cells (default: that layout's, one thread; the writers pass
    a :class:`shards.writer.CellEncoder` of the same layout). Raises ValueError for a row whose top-K
    arrays are missing or not ``[T, K]`` when the schema has them, FormatError for a schema without a
    header."""
    layout = layout_of_schema(schema)
    encode = encode or (lambda tensors: [layout.encode(t) for t in tensors])
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
    if layout.argmax:
        cols["argmax"] = _list_array([r.argmax for r in rows], pa.int32())
    if layout.topk:
        k = layout.topk
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
    for name in layout.columns:
        cols[name] = pa.array(encode([r.states[name] for r in rows]), type=STATE_TYPE)
    return pa.RecordBatch.from_arrays([cols[n] for n in schema.names], schema=schema)


def cell_check(schema: pa.Schema) -> str | None:
    """The checksum this schema's state cells end with (:attr:`shards.format.CellLayout.check`:
    ``xxh3_64`` from format 1.4, ``crc32`` in 1.3), or None."""
    return layout_of_schema(schema).check


def state_columns(table: pa.Table | pa.RecordBatch) -> list[str]:
    """The state columns (``tap_<k>``, ``final``) a table holds, in schema order."""
    return [f.name for f in table.schema if f.type == STATE_TYPE]


def state_tensor(table: pa.Table | pa.RecordBatch, column: str, row: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """States of ``column`` for ``row``: a ``[T, H]`` tensor of the run's dtype (bf16 or fp16), decoded in
    the cell layout of the header in ``table``'s schema (:func:`shards.format.layout_of_schema`: codec,
    checksum) straight from the Arrow buffer (no widening to float32, no per-element Python); written into
    ``out`` when given (e.g. ``sample[:, l]`` of a ``[T, L, H]`` sample, :func:`shards.codecs.decode`).
    ``table`` must include ``num_tokens``. Raises FormatError without it or without a header, ValueError
    for a cell that does not decode to ``[T, H]``, and FormatError for a damaged cell (its checksum, format
    1.3 on, or a zstd frame's checksum, 1.2 on, fails)."""
    layout = layout_of_schema(table.schema)
    if "num_tokens" not in table.column_names:
        raise FormatError(f"decoding {column} needs the num_tokens column; read it too")
    tokens = table.column("num_tokens")[row].as_py()
    return _decode_state(layout, column, table.column(column)[row].as_buffer(), tokens, row, out)


def _decode_state(layout: CellLayout, column: str, cell, tokens: int, row: int | None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`CellLayout.decode` of ``column``'s cell; with ``row`` (a shard table's row), a damaged cell
    raises FormatError naming column and row, else the codec's own error (CellError, ZstdError)."""
    try:
        return layout.decode(cell, tokens, out=out)
    except (codecs.CellError, zstandard.ZstdError) as e:  # the cell's checksum (1.3 on), a frame's checksum (1.2)
        if row is None:
            raise
        raise FormatError(f"{column} of row {row} does not decode ({e}): the shard is damaged; "
                          "`capture shards verify` names the file") from None


def topk_arrays(table: pa.Table | pa.RecordBatch, row: int, k: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """The top-K cells of ``row``: (int32 ``[T, K]`` ids, float32 ``[T, K]`` log-probabilities), or None
    when the table has no top-K columns. ``k``: K (default: the run header in the schema metadata,
    :attr:`shards.format.CellLayout.topk`). T is the row's token count (from ``input_ids``). Raises
    ValueError for a cell that does not decode to ``[T, K]``, FormatError when ``k`` is None and the
    schema has no header."""
    if topk_mod.IDS not in table.column_names:
        return None
    if k is None:
        k = layout_of_schema(table.schema).topk
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


def decode_sample(layout: CellLayout, value: Callable[[str], Any], columns: Sequence[str], topk: int = 0,
                  row: int | None = None) -> dict:
    """One row as a training sample, the contract of :mod:`shards.stream` (every sample reader's one
    decoder: ``ShardStream``, ``OnlineStream``, the HF ``datasets`` transform, export, Ray Data)::

        {"sample_id": str, "source": str, "input_ids": int64 [T], "loss_mask": bool [T],
         "argmax": int64 [T] (when layout.argmax), "taps": [T, L, H] (layout.dtype), "final": [T, H] (when asked),
         "topk_ids": int64 [T, K], "topk_logprobs": float32 [T, K] (when topk)}

    ``layout``: the cell layout the row was written in; ``value(column)``: the row's value of a column
    (strings as ``str``, ``input_ids`` / ``loss_mask`` / ``argmax`` as sequences: numpy arrays or lists,
    cells as buffers: ``pyarrow.Buffer`` or ``bytes``); ``columns``: the state columns to decode
    (:meth:`shards.format.CellLayout.columns_for`: the taps in order, each decoded straight into its
    slice of ``taps``, then ``final`` if asked); ``topk``: K of the top-K cells to decode (0: none).
    T is ``len(input_ids)``. ``row``: the row of a shard table, named when a damaged cell raises
    FormatError (None: the codec's CellError / ``zstandard.ZstdError`` as they are). Raises ValueError
    for a cell that does not decode to ``[T, H]`` (``[T, K]``)."""
    ids = np.asarray(value("input_ids"), dtype=np.int64)
    tokens = len(ids)
    out = {"sample_id": value("sample_id"), "source": value("source"), "input_ids": torch.from_numpy(ids),
           "loss_mask": torch.from_numpy(np.asarray(value("loss_mask"), dtype=np.bool_))}
    if layout.argmax:
        out["argmax"] = torch.from_numpy(np.asarray(value("argmax"), dtype=np.int64))
    taps = [c for c in columns if tap_layer(c) is not None]
    out["taps"] = torch.empty(tokens, len(taps), layout.hidden_size, dtype=layout.dtype)
    for i, c in enumerate(taps):  # each tap decodes straight into its slice of the sample: no stacking copy
        _decode_state(layout, c, value(c), tokens, row, out=out["taps"][:, i])
    if FINAL in columns:
        out["final"] = _decode_state(layout, FINAL, value(FINAL), tokens, row)
    if topk:
        out[topk_mod.IDS] = torch.from_numpy(topk_mod.decode_ids(value(topk_mod.IDS), topk, tokens).astype(np.int64))
        out[topk_mod.LOGPROBS] = torch.from_numpy(topk_mod.decode_logprobs(value(topk_mod.LOGPROBS), topk, tokens))
    return out


def table_sample(table: pa.Table | pa.RecordBatch, row: int, columns: Sequence[str], topk: int = 0) -> dict:
    """Row ``row`` of a shard table (a shard, an online payload, a Ray Data batch) as a training sample:
    :func:`decode_sample` in the layout of the header in the table's schema. Raises FormatError for a
    schema without a header or a damaged cell (naming column and row), ValueError as :func:`decode_sample`."""

    def value(name: str):
        scalar = table.column(name)[row]
        if pa.types.is_list(scalar.type):
            return scalar.values.to_numpy(zero_copy_only=False)
        if pa.types.is_binary(scalar.type) or pa.types.is_large_binary(scalar.type):
            return scalar.as_buffer()
        return scalar.as_py()

    return decode_sample(layout_of_schema(table.schema), value, columns, topk, row)
