"""The shard format: zstd-compressed Arrow IPC stream files, one row per conversation, and the run header.

Columns (schema first, in this order):

==================  ==========================  ==================================================
column              Arrow type                  meaning
==================  ==========================  ==================================================
sample_id           string                      stable id ``<dataset>:<row index>``
source              string                      the row's ``source`` column, else the dataset name
row_index           int64                       row of the raw dataset
input_ids           list<int32>                 ``[T]`` token ids (chat template applied)
loss_mask           list<bool>                  ``[T]`` True where the assistant produced the token
argmax              list<int32>                 ``[T]`` target's greedy prediction for token t+1 (if captured)
topk_ids            binary                      ``[T, K]`` int32 ids of the target's K most likely tokens t+1, one
                                                encoded cell (``--topk K``; :mod:`shards.topk`)
topk_logprobs       binary                      ``[T, K]`` float32 their log-probabilities, one encoded cell
num_tokens          int32                       T
num_loss_tokens     int32                       ``sum(loss_mask)``
token_sha256        string                      SHA-256 hex of the little-endian int32 bytes of input_ids
finish_reasons      list<string> (nullable)     ``"stop"``/``"length"`` per generated turn (regenerate); null
tap_<k>             large_binary                ``[T, H]`` states after decoder layer k, one encoded cell
final               large_binary                ``[T, H]`` final state (if stored), one encoded cell
==================  ==========================  ==================================================

Each state cell is one ``[T, H]`` tensor encoded by the run's codec (:mod:`shards.codecs`),
self-contained and already compressed, so the IPC stream itself is written uncompressed (ids, mask and
argmax are ~9 bytes a token next to kilobytes of states). Each state field's metadata records ``codec``,
``dtype`` (``bfloat16`` or ``float16``: some engines give fp16; the dtype a cell decodes to), ``shape``
and ``layer``. The schema metadata key ``capture`` holds the run header as JSON (:class:`RunHeader`:
format version, target, taps and conventions, hidden size, codec, chat template text and hash,
tokenizer hash, where the answers come from, engine). Readers refuse an unknown major version; 1.1 added
``finish_reasons`` and ``responses`` (a 1.0 header without ``responses`` means dataset answers, no
template kwargs). Rows are written by :func:`shards.rows.record_batch` and read back by its inverse
:func:`shards.rows.read_row`.

**Top-K (format 1.2).** A run captured with ``--topk K`` (header ``topk``: K; 0 or absent = none, the
schema is then exactly 1.1's) stores per token position t the target's K largest next-token
log-probabilities: the distribution it predicts for token t+1, the position convention of ``argmax``
(``topk_ids[t, 0] == argmax[t]``). Values are ``logit - logsumexp(all logits)`` in float32 over the
full vocabulary (not renormalized over the K kept), descending along K, ties to the lower token id; a
trainer recovers probabilities as ``exp(topk_logprobs)`` and the tail mass as
``1 - exp(topk_logprobs).sum(-1)``. Each column is one cell per row (``binary``: a 1.1 reader, which
takes every ``large_binary`` column for a state, ignores them); the cell layout, measured at 87.6 bytes a
token for K = 32, is in :mod:`shards.topk`; the field metadata records ``encoding``, ``dtype``, ``shape``
and ``k``. 1.1 shards read as before (``topk`` 0).

**Cell checksums (format 1.3, 1.4).** Every state cell ends with a checksum of its bytes, named by the
state fields' metadata ``check``: ``crc32`` (4 bytes) in 1.3, ``xxh3_64`` (8 bytes, ~40x faster to
check) from 1.4 (:data:`shards.codecs.CHECKS`). A run keeps the layout of the version that started it.

**Packed int4 (format 1.5).** ``int4-b32`` cells hold two codes a byte (``code + 7`` per nibble, low
first) instead of one (int8): the same decoded bits, ~7% more bytes, twice as fast through a reader's zstd
stage (:func:`shards.codecs._block_codec`). Earlier cells still decode (told apart by their size); a
reader older than 1.5 fails on a 1.5 ``int4-b32`` cell with a size error.

**The cell layout.** What a version means for the cells (the checksum, int4 packing) is decided here
once, by :func:`layout_of` (:attr:`RunHeader.layout`; a shard's own: :func:`layout_of_schema`): a
:class:`CellLayout` holds codec, checksum, format version, state dtype, hidden size, K, the state
columns, argmax and the final kind, encodes and decodes the run's state cells, and names the columns a
reader asks for (:meth:`CellLayout.columns_for`). Every encoder (:func:`shards.rows.record_batch`,
:class:`shards.writer.CellEncoder`) and the one sample decoder (:func:`shards.rows.decode_sample`) take it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

import pyarrow as pa
import torch

from common.errors import CaptureError
from shards import codecs
from shards import topk as topk_mod

FORMAT_VERSION = "1.5"
METADATA_KEY = b"capture"
STATE_TYPE = pa.large_binary()
TAP_PREFIX = "tap_"
FINAL = "final"
# What a header without a field means (headers written before the field existed).
DATASET_RESPONSES = {"mode": "dataset", "chat_template_kwargs": {}}
DEFAULT_ENGINE = {"name": "hf"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # a header's state dtype → the tensors' dtype
PACKED_INT4_FROM = (1, 5)  # format version from which int4-b32 cells hold two codes a byte
# Fields that must be equal for new shards to join an existing run (see shards.manifest).
RUN_IDENTITY = ("target", "taps", "columns", "hidden_size", "dtype", "codec", "argmax", "chat_template_sha256",
                "tokenizer_sha256", "responses", "engine", "topk")


class FormatError(CaptureError):
    """A shard that this version cannot read, or that contradicts its manifest."""


def tap_column(layer: int) -> str:
    """The column holding tap ``layer`` (the output of 0-based decoder layer ``layer``): ``tap_<layer>``."""
    return f"{TAP_PREFIX}{int(layer)}"


def tap_layer(column: str) -> int | None:
    """The decoder layer a ``tap_<k>`` column holds; None for any other column (e.g. ``final``)."""
    return int(column[len(TAP_PREFIX):]) if column.startswith(TAP_PREFIX) else None


def tap_layers(columns: Sequence[str]) -> tuple[int, ...]:
    """The decoder layers the ``tap_<k>`` columns among ``columns`` hold, in their order."""
    return tuple(k for k in map(tap_layer, columns) if k is not None)


@dataclasses.dataclass(frozen=True)
class RunHeader:
    """The run header: stored in every shard's schema metadata and as the manifest's first line.

    ``columns``: the state columns in order (``tap_<k>`` in tap order, then ``final`` if stored);
    ``taps``: ``{"layers", "final", "tap_convention", "final_convention"}`` as :class:`capture.targets.Taps`
    describes them; ``responses``: ``{"mode": "dataset"|"regenerate", ...}`` (see
    :func:`capture.regenerate.responses_header`); ``engine``: ``{"name": ..., ...}`` as
    :meth:`capture.engines.EngineSpec.describe` gives it. ``topk``: K of the stored top-K log-probabilities
    (0: none; a header from before format 1.2 has no such field and means 0). ``extra``: fields a newer
    minor version wrote, kept as they are so that a copy (recode) loses nothing.
    """

    target: dict
    taps: dict
    columns: tuple[str, ...]
    hidden_size: int
    dtype: str
    codec: str
    argmax: bool
    chat_template: str
    chat_template_sha256: str
    tokenizer_sha256: str
    responses: dict = dataclasses.field(default_factory=lambda: dict(DATASET_RESPONSES))
    engine: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_ENGINE))
    engine_version: str | None = None
    topk: int = 0
    format_version: str = FORMAT_VERSION
    extra: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        codecs.check(self.codec, self.dtype)
        object.__setattr__(self, "columns", tuple(self.columns))
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or not 0 <= self.topk <= topk_mod.MAX_K:
            raise FormatError(f"run header: topk {self.topk!r} is not an integer in [0, {topk_mod.MAX_K}]")

    # ------------------------------------------------------------ (de)serialization

    @classmethod
    def from_dict(cls, data: dict) -> "RunHeader":
        """A header from its JSON object (a manifest line's ``kind`` key is ignored), old versions'
        missing fields filled with what they meant. Raises FormatError for an unknown major version or a
        missing field."""
        check_version(str(data.get("format_version", "?")))
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise FormatError(f"run header lacks {', '.join(missing)}")
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names and k not in ("kind", "lossless")}
        for key, default in (("responses", DATASET_RESPONSES), ("engine", DEFAULT_ENGINE)):
            if known.get(key) is None:
                known[key] = dict(default)
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        """The JSON object (``lossless`` added for readers of the raw JSON; ``engine_version`` only when known)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["columns"] = list(self.columns)
        out["lossless"] = self.lossless
        if self.engine_version is None:
            del out["engine_version"]
        return {**self.extra, **out}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    def replace(self, **changes: Any) -> "RunHeader":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ what the columns mean

    @property
    def layout(self) -> "CellLayout":
        """The run's cell layout (:func:`layout_of`)."""
        return layout_of(self)

    @property
    def cell_check(self) -> str | None:
        """The checksum state cells end with (:attr:`CellLayout.check`)."""
        return _cell_check(self.format_version)

    @property
    def lossless(self) -> bool:
        return codecs.LOSSLESS[self.codec]

    @property
    def tap_columns(self) -> tuple[str, ...]:
        """The ``tap_<k>`` columns in header order."""
        return tuple(c for c in self.columns if tap_layer(c) is not None)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The tapped decoder layers in header order (tap k = output of 0-based decoder layer k)."""
        return tap_layers(self.columns)

    @property
    def final_kind(self) -> str | None:
        """``post-norm``/``pre-norm`` when the run stored the final state, else None."""
        return self.taps.get("final") if FINAL in self.columns else None

    def layer_of(self, column: str) -> str:
        """The ``layer`` recorded in a state field's metadata: k for ``tap_k``, the final kind for ``final``."""
        k = tap_layer(column)
        return str(k) if k is not None else str(self.taps["final"])

    @property
    def mode(self) -> str:
        """Where the answers come from: ``dataset`` or ``regenerate``."""
        return self.responses.get("mode", "dataset")

    @property
    def raw_bytes_per_token(self) -> int:
        """Bytes of the states of one token before coding (2 bytes a value: bf16 or fp16)."""
        return len(self.columns) * self.hidden_size * 2

    # ------------------------------------------------------------ run identity

    def identity(self) -> dict:
        """The fields that make a run one run (RUN_IDENTITY); a missing field means its default."""
        d = self.to_dict()
        return {k: d.get(k) for k in RUN_IDENTITY}

    def identity_diff(self, other: "RunHeader") -> list[str]:
        """Fields of RUN_IDENTITY on which two headers disagree."""
        mine, theirs = self.identity(), other.identity()
        return [k for k in RUN_IDENTITY if mine[k] != theirs[k]]


def _version(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _cell_check(version: str) -> str | None:
    """The checksum a format version's state cells end with: ``xxh3_64`` from 1.4, ``crc32`` in 1.3, None
    before (minor versions compare as numbers)."""
    v = _version(version)
    return "xxh3_64" if v >= (1, 4) else "crc32" if v == (1, 3) else None


@dataclasses.dataclass(frozen=True)
class CellLayout:
    """How a run's state cells are written and read, decided once from its header (:func:`layout_of`).

    ``codec``: the state codec (:mod:`shards.codecs`); ``check``: the checksum each state cell ends with
    (:data:`shards.codecs.CHECKS`: ``xxh3_64`` from format 1.4, ``crc32`` in 1.3, None before);
    ``packed``: ``int4-b32`` codes go two a byte (format 1.5 on; one a byte before). A run keeps the
    layout of the version that started it (a resume writes what its header says). ``dtype``: the torch
    dtype a state cell decodes to (bf16 or fp16); ``hidden_size``: H of every ``[T, H]`` cell; ``topk``: K
    of the top-K cells (0: none); ``columns``: the state columns in header order (``tap_<k>``, then
    ``final`` if stored); ``argmax``: whether rows hold ``argmax``; ``final_kind``: ``post-norm`` /
    ``pre-norm`` when ``final`` is stored, else None.
    """

    codec: str
    check: str | None
    packed: bool
    format_version: str
    dtype: torch.dtype
    hidden_size: int
    topk: int
    columns: tuple[str, ...]
    argmax: bool
    final_kind: str | None

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The tapped decoder layers in header order."""
        return tap_layers(self.columns)

    def columns_for(self, layers: Sequence[int] | None = None, final: bool = True) -> tuple[str, ...]:
        """The state columns a reader decodes: ``tap_<k>`` for each of ``layers`` in that order (None: every
        tap, header order), then ``final`` when ``final`` and the run stored it. Raises CaptureError for a
        tap the run lacks (or no tap at all): every reader's one message."""
        taps = list(self.tap_layers)
        wanted = taps if layers is None else [int(k) for k in layers]
        missing = [k for k in wanted if k not in taps]
        if missing or not wanted:
            raise CaptureError(f"no tap(s) {missing or wanted} in this run; it stored taps {taps}")
        return tuple(map(tap_column, wanted)) + ((FINAL,) if final and self.final_kind is not None else ())

    def encode(self, states: torch.Tensor) -> bytes:
        """One ``[T, H]`` tensor (bf16 or fp16) → one state cell of this layout (codec, packing, checksum).
        Raises ValueError for a tensor the codec cannot store."""
        return codecs.encode(self.codec, states, check=self.check, packed=self.packed)

    def decode(self, cell, tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """One state cell (any buffer) → ``[tokens, hidden_size]`` tensor of :attr:`dtype`, written into
        ``out`` when given (:func:`shards.codecs.decode`). Raises :class:`shards.codecs.CellError` when
        its checksum fails, ``zstandard.ZstdError`` for a damaged frame, ValueError on a size mismatch."""
        return codecs.decode(self.codec, cell, tokens, self.hidden_size, self.dtype, check=self.check, out=out)


def layout_of(head: RunHeader) -> CellLayout:
    """The cell layout of a run started with ``head`` (its format version decides checksum and int4
    packing). Raises FormatError for a state dtype this capture cannot decode to."""
    if head.dtype not in DTYPES:
        raise FormatError(f"state dtype {head.dtype!r} is not one of {', '.join(DTYPES)}")
    return CellLayout(codec=head.codec, check=_cell_check(head.format_version),
                      packed=_version(head.format_version) >= PACKED_INT4_FROM, format_version=head.format_version,
                      dtype=DTYPES[head.dtype], hidden_size=head.hidden_size, topk=head.topk, columns=head.columns,
                      argmax=head.argmax, final_kind=head.final_kind)


def layout_of_schema(schema_: pa.Schema) -> CellLayout:
    """The cell layout of a shard (or a table of its rows: a payload, a Ray Data batch) from the run header
    in its schema metadata; cached by that header's bytes, so a reader may ask once per row. Raises
    FormatError for a missing header or an unknown major version."""
    return _layout_of_json(_raw_header(schema_))


@functools.lru_cache(maxsize=64)
def _layout_of_json(raw: bytes) -> CellLayout:
    return layout_of(RunHeader.from_dict(json.loads(raw)))


def header(*, target: dict, taps: dict, columns: list[str], hidden_size: int, dtype: str, codec: str,
           argmax: bool, chat_template: str, chat_template_sha256: str, tokenizer_sha256: str,
           responses: dict | None = None, engine: dict | None = None, engine_version: str | None = None,
           topk: int = 0) -> RunHeader:
    """A new run's header. ``responses``: see :func:`capture.regenerate.responses_header` (None: dataset
    answers); ``engine``: :meth:`capture.engines.EngineSpec.describe` (None: hf); ``topk``: K of the stored
    top-K log-probabilities (0: none). Raises CaptureError for an unknown codec or a K out of range."""
    return RunHeader(target=target, taps=taps, columns=tuple(columns), hidden_size=hidden_size, dtype=dtype,
                     codec=codec, argmax=argmax, chat_template=chat_template,
                     chat_template_sha256=chat_template_sha256, tokenizer_sha256=tokenizer_sha256,
                     responses=responses or dict(DATASET_RESPONSES), engine=engine or dict(DEFAULT_ENGINE),
                     engine_version=engine_version, topk=topk)


def schema(head: RunHeader) -> pa.Schema:
    """The Arrow schema for a run described by ``head``."""
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("row_index", pa.int64(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
    ]
    if head.argmax:
        fields.append(pa.field("argmax", pa.list_(pa.int32()), nullable=False))
    if head.topk:
        fields += [pa.field(c, topk_mod.TYPE, nullable=False, metadata=topk_mod.field_metadata(c, head.topk))
                   for c in topk_mod.COLUMNS]
    fields += [
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("num_loss_tokens", pa.int32(), nullable=False),
        pa.field("token_sha256", pa.string(), nullable=False),
        pa.field("finish_reasons", pa.list_(pa.string()), nullable=True),
    ]
    for column in head.columns:
        meta = {"codec": head.codec, "dtype": head.dtype, "shape": f"[T, {head.hidden_size}]",
                "layer": head.layer_of(column)} | ({"check": head.cell_check} if head.cell_check else {})
        fields.append(pa.field(column, STATE_TYPE, nullable=False, metadata=meta))
    return pa.schema(fields, metadata={METADATA_KEY: head.to_json()})


def read_header(schema_: pa.Schema) -> RunHeader:
    """The header of a shard's schema. Raises FormatError for a missing header or unknown major version."""
    return RunHeader.from_dict(json.loads(_raw_header(schema_)))


def _raw_header(schema_: pa.Schema) -> bytes:
    raw = (schema_.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise FormatError("not a capture shard: no 'capture' header in the schema metadata")
    return raw


def check_version(version: str) -> None:
    """Raise FormatError unless ``version``'s major number is this capture's."""
    major = version.split(".")[0]
    if major != FORMAT_VERSION.split(".")[0]:
        raise FormatError(
            f"shard format version {version} is not readable by this capture (reads {FORMAT_VERSION.split('.')[0]}.x); "
            "upgrade capture or recode the shards"
        )


def read_ipc(source, label: str, columns: list[str] | None = None) -> pa.Table:
    """All record batches of one shard from ``source`` (a seekable pyarrow input: a memory map or an
    input file), or only ``columns`` (the others are not read into memory); ``num_tokens`` comes along
    with any state column (a cell decodes with its row's token count). ``label`` names the shard in
    errors. Raises FormatError for an unknown format version or an unknown column."""
    schema_ = pa.ipc.open_stream(source).schema
    read_header(schema_)
    if columns is None:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()
    missing = [c for c in columns if c not in schema_.names]
    if not columns or missing:
        raise FormatError(f"{label}: no column(s) {missing or columns} (it has {', '.join(schema_.names)})")
    if any(schema_.field(c).type == STATE_TYPE for c in columns) and "num_tokens" not in columns:
        columns = [*columns, "num_tokens"]
    options = pa.ipc.IpcReadOptions(included_fields=[schema_.get_field_index(c) for c in columns])
    source.seek(0)
    return pa.ipc.open_stream(source, options=options).read_all()
