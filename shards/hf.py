"""Hugging Face ``datasets`` over a run: :func:`hf_dataset`, and :func:`decoder` for the state cells.

A ``datasets.Dataset`` does not keep the run header: ``Dataset.from_file`` on a shard keeps only its own
``huggingface`` schema metadata, and a state column (``tap_<k>``, ``final``) is an opaque
``large_binary`` cell (one ``[T, H]`` tensor encoded by the run's codec). :func:`decoder` takes the
header from the run and gives a transform for ``Dataset.set_transform`` / ``with_transform`` that turns
the rows into the sample dicts of :class:`shards.stream.ShardStream`, bit for bit::

    ds = hf_dataset("runs/a", split="train", states=True)     # the one line
    ds[0]["taps"]                                               # bf16 [T, L, H]

    ds = datasets.Dataset.from_file("runs/a/shard-....arrow")   # one shard, header lost
    ds = ds.with_transform(decoder("runs/a"))                   # or decoder("runs/a/shard-....arrow")

Per sample (``ds[i]``; a slice ``ds[i:j]`` gives a list per key)::

    {"sample_id": str, "source": str,
     "input_ids": int64 [T], "loss_mask": bool [T],
     "argmax": int64 [T]            (if the run stored it),
     "taps": bf16 [T, L, H]         (the tap columns stacked in header order, or in ``layers`` order),
     "final": bf16 [T, H]           (if the run stored it and ``final``),
     "topk_ids": int64 [T, K], "topk_logprobs": float32 [T, K]   (if the run stored top-K and ``topk``)}

A run's top-K cells (``topk_ids``, ``topk_logprobs``: encoded ``binary`` cells, :mod:`shards.topk`) are,
like the states, left out of the plain ``hf_dataset(run)`` (name them in ``columns`` to get the encoded
bytes) and decoded by the transform.

States keep the run's dtype (bf16; fp16 for engines that give fp16). The transform decodes the cells
that ``datasets`` hands it as Python ``bytes`` (one copy of each cell per access; ``ShardStream``
decodes straight from the memory-mapped Arrow buffers and is the faster reader for training), in the
run header's cell layout, by the sample decoder ``ShardStream`` uses (:func:`shards.rows.decode_sample`).
``ds.with_format(...)`` or ``set_format`` replaces the transform: set it again afterwards.
"""

from __future__ import annotations

import os
from typing import Sequence

import pyarrow as pa
import pyarrow.fs as pafs
import torch

from common.errors import CaptureError
from shards import manifest as manifest_mod
from shards.format import FINAL, FormatError, RunHeader, read_header, tap_layers
from shards import topk as topk_mod
from shards.rows import decode_sample
from shards.run import Location, as_location
from shards.stream import SPLITS, in_split

SCALARS = ("sample_id", "source", "input_ids", "loss_mask")


def run_header(run: str | os.PathLike | Location | RunHeader) -> RunHeader:
    """The run header of ``run``: a run folder (path, URI or :class:`shards.run.Location`; read from its
    manifest), one shard file of a run (read from its schema metadata), or a :class:`RunHeader` as is.
    Raises CaptureError for a folder without a run, FormatError for a file that is not a capture shard
    or has an unknown major format version."""
    if isinstance(run, RunHeader):
        return run
    loc = as_location(run)
    if loc.kind() == pafs.FileType.File:
        try:
            with loc.filesystem.open_input_stream(loc.path) as f:
                return read_header(pa.ipc.open_stream(f).schema)
        except (OSError, pa.ArrowInvalid) as e:
            raise FormatError(f"cannot read a shard header from {run}: {e}") from None
    manifest = manifest_mod.read(loc)
    if manifest.header is None:
        raise CaptureError(f"{run} holds no capture run (no {loc.manifest_name} with a header)")
    return manifest.header


class Decoder:
    """A ``datasets`` transform (see :func:`decoder`): called with a batch ``{column: list}``, returns
    ``{key: list}`` of the module docstring's sample contract, one entry per row. Picklable (DataLoader
    workers can take a dataset that holds it).

    ``header``: the run header; ``taps_layers``: the taps stacked into ``taps``, in that order;
    ``final``: whether ``final`` is returned; ``topk``: K of the top-K arrays returned (0: none, also when
    the run stored none); ``columns``: the dataset columns it reads (pass them as
    ``with_transform(dec, columns=dec.columns)`` so that ``datasets`` extracts no other state cells).
    """

    def __init__(self, header: RunHeader, layers: Sequence[int] | None = None, final: bool = True, topk: bool = True):
        self.header = header
        self.layout = header.layout  # FormatError for a state dtype no tensor has
        self.states: tuple[str, ...] = self.layout.columns_for(layers, final)  # the state columns decoded
        self.taps_layers: tuple[int, ...] = tap_layers(self.states)
        self.final: bool = FINAL in self.states
        self.topk: int = header.topk if topk else 0
        self.columns: tuple[str, ...] = (SCALARS + (("argmax",) if header.argmax else ())
                                         + (topk_mod.COLUMNS if self.topk else ()) + self.states)
        self.keys: tuple[str, ...] = (SCALARS + (("argmax",) if header.argmax else ()) + ("taps",)  # of a sample
                                      + ((FINAL,) if self.final else ()) + (topk_mod.COLUMNS if self.topk else ()))

    def __call__(self, batch: dict) -> dict[str, list]:
        missing = [c for c in self.columns if c not in batch]
        if missing:
            raise CaptureError(f"the dataset lacks column(s) {missing} that decoding needs (it has "
                               f"{', '.join(batch)}); hf_dataset(..., states=True) keeps them")
        samples = [decode_sample(self.layout, lambda c, i=i: batch[c][i], self.states, self.topk)
                   for i in range(len(batch["input_ids"]))]
        return {k: [s[k] for s in samples] for k in self.keys}

    def __repr__(self) -> str:
        return (f"Decoder(taps_layers={self.taps_layers}, final={self.final}, topk={self.topk}, "
                f"codec={self.header.codec!r})")


def decoder(run: str | os.PathLike | Location | RunHeader, layers: Sequence[int] | None = None,
            final: bool = True, topk: bool = True) -> Decoder:
    """A transform for ``datasets.Dataset.set_transform`` / ``with_transform`` that decodes a capture
    dataset's rows into :class:`shards.stream.ShardStream`'s sample contract (module docstring):
    ``input_ids`` int64 ``[T]``, ``loss_mask`` bool ``[T]``, ``argmax`` int64 ``[T]`` (if stored),
    ``taps`` ``[T, L, H]`` in the run's dtype (bf16, or fp16), ``final`` ``[T, H]`` (if stored and
    ``final``), ``topk_ids`` int64 ``[T, K]`` and ``topk_logprobs`` float32 ``[T, K]`` (if stored and
    ``topk``), plus ``sample_id`` and ``source``; the other columns are dropped.

    ``run``: where the header comes from (:func:`run_header`: a run folder, path or URI, a shard file of
    the run, or a RunHeader). ``layers``: the taps to stack, in that order (default all, header order).
    ``final``: return the final state when the run stored it. ``topk``: return the top-K arrays when
    the run stored them.

    Raises CaptureError for a run without a header or a tap the run lacks (here), and, when the
    transform runs, for a dataset lacking a column it needs (``sample_id``, ``source``, ``input_ids``,
    ``loss_mask``, ``argmax`` and the top-K cells if stored, the state columns); ValueError (or zstd's
    error, or :class:`shards.codecs.CellError` for a failed checksum) for a cell that does not decode to
    ``[T, H]``.
    """
    return Decoder(run_header(run), layers, final, topk)


def hf_dataset(run: str | os.PathLike | Location, *, split: str = "all", heldout_fraction: float = 0.01,
               columns: Sequence[str] | None = None, states: bool = False, layers: Sequence[int] | None = None,
               final: bool = True, topk: bool = True):
    """The run's rows as a Hugging Face ``datasets.Dataset`` (zero-copy over the memory-mapped shards), in
    manifest order, filtered by ``split`` as :func:`shards.stream.in_split`.

    ``states=False`` (default): plain columns, by default every column but the states (``sample_id``,
    ``source``, ``row_index``, ``input_ids``, ``loss_mask``, ``argmax``, ``num_tokens``, ...; the encoded
    state and top-K cells are left out), or those named in ``columns``; a state or top-K column named
    there comes as its encoded cell bytes.

    ``states=True``: the dataset also holds the state columns (the taps ``layers``, default all, and
    ``final`` when stored and asked) and carries the :func:`decoder` transform, so that ``ds[i]`` is a
    :class:`shards.stream.ShardStream` sample: ``input_ids`` int64 ``[T]``, ``loss_mask`` bool ``[T]``,
    ``argmax`` int64 ``[T]``, ``taps`` bf16 ``[T, L, H]``, ``final`` bf16 ``[T, H]``, ``topk_ids`` /
    ``topk_logprobs`` ``[T, K]`` (``--topk`` runs), ``sample_id``, ``source``. ``columns`` does not
    combine with it; ``layers`` / ``final`` / ``topk`` apply only with it.

    Raises CaptureError for a folder without a run or without committed shards, an unknown column or
    split, a tap the run lacks, or ``columns`` with ``states=True``.
    """
    import datasets
    from datasets.table import InMemoryTable

    if states and columns is not None:
        raise CaptureError("hf_dataset: states=True returns the decoded sample dicts; it takes no columns")
    if not states and (layers is not None or not final or not topk):
        raise CaptureError("hf_dataset: layers, final and topk choose the decoded states; pass states=True")
    loc = as_location(run)
    manifest = manifest_mod.read(loc)
    if manifest.header is None:
        raise CaptureError(f"{run} holds no capture run (no {loc.manifest_name} with a header)")
    dec = Decoder(manifest.header, layers, final, topk) if states else None
    if split not in SPLITS:
        raise CaptureError(f"unknown split {split!r}; one of {', '.join(SPLITS)}")
    state_columns = set(manifest.header.columns) | set(topk_mod.COLUMNS)  # encoded cells
    tables = []
    for shard in manifest.shards:
        table = loc.read_table(shard["path"], rows=shard["rows"])  # local: memory-mapped, unselected columns are never touched
        if columns is not None:
            cols = list(columns)
        else:
            cols = [c for c in table.column_names if c not in state_columns or (dec and c in dec.columns)]
        unknown = [c for c in cols if c not in table.column_names]
        if unknown:
            raise CaptureError(f"no column(s) {unknown} in {run}; it has {', '.join(table.column_names)}")
        table = table.select(cols)
        keep = [in_split(sid, split, heldout_fraction) for sid in shard["sample_ids"]]
        tables.append(table.filter(pa.array(keep, pa.bool_())))
    if not tables:
        raise CaptureError(f"{run} has no committed shard yet")
    table = pa.concat_tables(tables).replace_schema_metadata(None)
    if table.num_rows == 0:  # every row filtered out: columns without chunks, which datasets cannot cast
        table = table.schema.empty_table()
    ds = datasets.Dataset(InMemoryTable(table))
    return ds.with_transform(dec, columns=list(dec.columns)) if dec is not None else ds
