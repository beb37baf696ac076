"""The shard format: zstd-compressed Arrow IPC stream files, one row per conversation.

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
num_tokens          int32                       T
num_loss_tokens     int32                       ``sum(loss_mask)``
token_sha256        string                      SHA-256 hex of the little-endian int32 bytes of input_ids
finish_reasons      list<string> (nullable)     ``"stop"``/``"length"`` per generated turn (regenerate); null
tap_<k>             large_binary                ``[T, H]`` states after decoder layer k, one encoded cell
final               large_binary                ``[T, H]`` final state (if stored), one encoded cell
==================  ==========================  ==================================================

Each state cell is one ``[T, H]`` tensor encoded by the run's codec (:mod:`shards.codecs`: ``bf16``,
``bf16-split``, ``fp8-e4m3``), self-contained and already compressed, so the IPC stream itself is
written uncompressed (ids, mask and argmax are ~9 bytes a token next to kilobytes of states). Each state
field's metadata records ``codec``, ``dtype`` (``bfloat16`` or ``float16``: some engines give fp16; the
dtype a cell decodes to), ``shape`` and ``layer``. The schema metadata key
``capture`` holds a JSON header (:func:`header`): format version, target, taps and conventions, hidden
size, codec, chat template text and hash, tokenizer hash, and ``responses``: where the answers come from
(``mode`` ``dataset`` or ``regenerate``; for regenerate the policy, sampling parameters and stop ids; the
chat template kwargs). Readers refuse an unknown major version; 1.1 added ``finish_reasons`` and
``responses`` (a 1.0 header without ``responses`` means dataset answers, no template kwargs).
"""

from __future__ import annotations

import json

import pyarrow as pa

from capture.errors import CaptureError
from shards import codecs

FORMAT_VERSION = "1.1"
METADATA_KEY = b"capture"
STATE_TYPE = pa.large_binary()


class FormatError(CaptureError):
    """A shard that this version cannot read, or that contradicts its manifest."""


def schema(header: dict) -> pa.Schema:
    """The Arrow schema for a run described by ``header`` (see :func:`header`)."""
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("row_index", pa.int64(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
    ]
    if header["argmax"]:
        fields.append(pa.field("argmax", pa.list_(pa.int32()), nullable=False))
    fields += [
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("num_loss_tokens", pa.int32(), nullable=False),
        pa.field("token_sha256", pa.string(), nullable=False),
        pa.field("finish_reasons", pa.list_(pa.string()), nullable=True),
    ]
    for column in header["columns"]:
        layer = column.removeprefix("tap_") if column.startswith("tap_") else header["taps"]["final"]
        meta = {"codec": header["codec"], "dtype": header["dtype"], "shape": f"[T, {header['hidden_size']}]",
                "layer": str(layer)}
        fields.append(pa.field(column, STATE_TYPE, nullable=False, metadata=meta))
    return pa.schema(fields, metadata={METADATA_KEY: json.dumps(header, sort_keys=True).encode()})


def header(*, target: dict, taps: dict, columns: list[str], hidden_size: int, dtype: str, codec: str,
           argmax: bool, chat_template: str, chat_template_sha256: str, tokenizer_sha256: str,
           responses: dict | None = None) -> dict:
    """The run header stored in every shard's schema metadata and as the manifest's first line.
    ``responses``: see :func:`capture.regenerate.responses_header` (None: dataset answers)."""
    codecs.check(codec)
    return {
        "format_version": FORMAT_VERSION,
        "target": target,
        "taps": taps,
        "columns": columns,
        "hidden_size": hidden_size,
        "dtype": dtype,
        "codec": codec,
        "lossless": codecs.LOSSLESS[codec],
        "argmax": argmax,
        "chat_template": chat_template,
        "chat_template_sha256": chat_template_sha256,
        "tokenizer_sha256": tokenizer_sha256,
        "responses": responses or {"mode": "dataset", "chat_template_kwargs": {}},
    }


def read_header(schema_: pa.Schema) -> dict:
    """The header of a shard's schema. Raises FormatError for a missing header or unknown major version."""
    raw = (schema_.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise FormatError("not a capture shard: no 'capture' header in the schema metadata")
    head = json.loads(raw)
    check_version(head.get("format_version", "?"))
    return head


def check_version(version: str) -> None:
    major = version.split(".")[0]
    if major != FORMAT_VERSION.split(".")[0]:
        raise FormatError(
            f"shard format version {version} is not readable by this capture (reads {FORMAT_VERSION.split('.')[0]}.x); "
            "upgrade capture or recode the shards"
        )


# Fields that must be equal for new shards to join an existing run (see shards.manifest).
RUN_IDENTITY = ("target", "taps", "columns", "hidden_size", "dtype", "codec", "argmax", "chat_template_sha256",
                "tokenizer_sha256", "responses", "engine")
# What a header without a field means (headers written before the field existed).
DATASET_RESPONSES = {"mode": "dataset", "chat_template_kwargs": {}}
IDENTITY_DEFAULTS = {"responses": DATASET_RESPONSES, "engine": {"name": "hf"}}
