"""The manifest: ``manifest.jsonl`` in the run folder, the run's only commit log.

Line 1 is the run header (``{"kind": "header", ...}``, see :func:`shards.format.header`). Each shard is
committed by appending one ``{"kind": "shard", ...}`` line (path, rows, tokens, loss tokens, bytes,
sha256, sample ids, token hashes) with an fsync: a shard file no line names is not part of the run.
A finished run appends ``{"kind": "complete", ...}`` (counts by reason, end time); a resumed or extended
run appends more shard lines and another completion record. A line torn by a crash (no trailing newline)
is not committed: readers ignore it and the next writer cuts it off before appending.

Outside a local folder (an object store, see :mod:`shards.fs`) nothing can be appended, and rewriting one
manifest object per commit would be quadratic, so the same log is one small object per entry:
``manifest.d/<seq:010d>-<kind>.json``, each holding exactly one manifest line, numbered from 0 in commit
order (header first). An entry object is written whole and appears at once when closed, so writing it is
the commit; there is no torn tail. The driver is the run's only writer and numbers the entries; readers
list ``manifest.d/``, sort the names and parse the lines as one ``manifest.jsonl`` (:func:`read_fs`).
An object store has no lock: a capture marks the run with a ``.capture.lock`` object (:func:`lock_object`),
which is advisory (two captures started at the same instant are not told apart).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path, PurePath, PurePosixPath

import pyarrow.fs as pafs

from capture.errors import CaptureError
from shards.fs import Location, as_location
from shards.format import IDENTITY_DEFAULTS, RUN_IDENTITY, check_version
from shards.writer import ShardInfo

log = logging.getLogger(__name__)

MANIFEST = "manifest.jsonl"
MANIFEST_DIR = "manifest.d"  # the manifest of a run on an object store: one object per entry
ENTRY = re.compile(r"(\d{10})-[a-z]+\.json")
LOCK = ".capture.lock"  # held by the one process writing a run folder (capture run, recode)
REQUIRED = {  # keys each kind of line must have
    "header": ("format_version", "columns", "hidden_size", "codec"),
    "shard": ("path", "rows", "tokens", "loss_tokens", "bytes", "sha256", "sample_ids", "token_sha256"),
    "dataset": ("dataset",),
    "complete": (),
}


@dataclasses.dataclass
class Manifest:
    """A parsed manifest. ``committed_bytes``: length of its complete lines (a torn tail lies beyond)."""

    header: dict | None
    shards: list[dict]
    completions: list[dict]
    committed_bytes: int
    last_kind: str | None = None
    datasets: list[dict] = dataclasses.field(default_factory=list)  # every dataset the run has read

    @property
    def complete(self) -> bool:
        """True when the last committed line is a completion record (nothing was appended since)."""
        return self.last_kind == "complete"

    def sample_ids(self) -> set[str]:
        return {s for shard in self.shards for s in shard["sample_ids"]}

    def token_hashes(self) -> set[str]:
        return {h for shard in self.shards for h in shard["token_sha256"]}


def read(run_dir: str | os.PathLike | Location) -> Manifest:
    """Parse ``run_dir/manifest.jsonl`` (a run on an object store: its ``manifest.d/``, see
    :func:`read_fs`); a missing manifest gives an empty Manifest.

    Raises CaptureError for a corrupt line in the middle (only the last line may be torn) or an unknown
    major format version.
    """
    loc = as_location(run_dir)
    if not loc.local:
        return read_fs(loc.filesystem, loc.path)
    path = Path(loc.path) / MANIFEST
    if not path.exists():
        return Manifest(None, [], [], 0)
    return parse(path.read_bytes(), str(path))


def read_fs(filesystem: pafs.FileSystem, run_dir: str) -> Manifest:
    """The manifest of the run at ``run_dir`` on ``filesystem``: ``manifest.jsonl`` when there is one,
    else the entries of ``manifest.d/`` in order; neither gives an empty Manifest. Raises CaptureError
    as :func:`read` does, and for a missing or malformed entry object."""
    loc = Location(filesystem, run_dir, False)
    try:
        return parse(loc.read_bytes(MANIFEST), loc.join(MANIFEST))
    except FileNotFoundError:
        pass
    data = []
    for i, name in enumerate(n for n in loc.names(MANIFEST_DIR) if ENTRY.fullmatch(n)):
        entry = loc.read_bytes(f"{MANIFEST_DIR}/{name}")
        if int(name[:10]) != i:
            raise CaptureError(f"{loc.join(MANIFEST_DIR)}: entry {i} is missing (next is {name}); the manifest is damaged")
        if not entry.endswith(b"\n") or b"\n" in entry[:-1]:
            raise CaptureError(f"{loc.join(MANIFEST_DIR)}/{name} is not one manifest line; the manifest is damaged")
        data.append(entry)
    return parse(b"".join(data), loc.join(MANIFEST_DIR))


def parse(data: bytes, path: str = MANIFEST) -> Manifest:
    """Parse the bytes of a manifest (read from any file system); ``path`` names it in errors.
    Raises CaptureError as :func:`read` does."""
    end = data.rfind(b"\n") + 1  # everything after the last newline is a torn, uncommitted line
    header, shards, completions, datasets = None, [], [], []
    kind = None
    for i, line in enumerate(data[:end].splitlines()):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            raise CaptureError(f"{path}: line {i + 1} is not valid JSON; the manifest is damaged") from None
        kind = entry.get("kind") if isinstance(entry, dict) else None
        missing = [k for k in REQUIRED.get(kind, ("kind",)) if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise CaptureError(f"{path}: line {i + 1} lacks {', '.join(missing)}; the manifest is damaged")
        if kind == "header":
            check_version(entry["format_version"])
            header = entry
        elif kind == "shard":
            shards.append(entry)
        elif kind == "dataset":
            datasets.append(entry["dataset"])
        elif kind == "complete":
            completions.append(entry)
    return Manifest(header, shards, completions, end, kind, datasets)


def identity_diff(old: dict, new: dict) -> list[str]:
    """Fields of RUN_IDENTITY on which two run headers disagree (a missing field means its default)."""
    return [k for k in RUN_IDENTITY if old.get(k, IDENTITY_DEFAULTS.get(k)) != new.get(k, IDENTITY_DEFAULTS.get(k))]


def check_dataset(manifest: Manifest, ref: dict) -> bool:
    """Whether ``ref`` (a dataset: name, path, revision, ...) is new to the run.

    Sample ids are ``<name>:<row>``, so one name must always mean one file: another path under a name the
    run already read raises CaptureError; the same file with other content (a grown dataset) is allowed
    with a warning (committed rows are not re-read).
    """
    new = True
    for seen in (d for d in manifest.datasets if d["name"] == ref["name"]):
        if seen["path"] != ref["path"]:
            raise CaptureError(
                f"this run read dataset {ref['name']!r} from {seen['path']}; {ref['path']} has the same name, so "
                "its sample ids would collide with the committed ones; use another --out"
            )
        if seen["revision"] == ref["revision"]:
            new = False
        else:
            log.warning("dataset %s changed since this run read it (revision %s → %s): committed rows are not "
                        "re-read; if rows were edited rather than appended, use another --out",
                        ref["name"], seen["revision"][:12], ref["revision"][:12])
    return new


class ManifestWriter:
    """Appends commits to a run's manifest. Open with :meth:`open`; only the driver holds one."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def open(cls, run_dir: str | os.PathLike | Location, header: dict) -> tuple["ManifestWriter", Manifest]:
        """Create the run folder and manifest, or reopen an existing run with the same identity. On an
        object store the writer is an :class:`ObjectManifestWriter`.

        Raises CaptureError when the existing run was made with a different target, taps, codec,
        template or tokenizer (the message lists the fields and both values).
        """
        loc = as_location(run_dir)
        if loc.local:
            run_dir = Path(loc.path)
            run_dir.mkdir(parents=True, exist_ok=True)
        else:
            run_dir = loc.path
            if loc.exists(MANIFEST):  # read_fs would read it and never see a new entry object
                raise CaptureError(f"{run_dir} holds a {MANIFEST} (a run copied from a local folder); runs on an "
                                   f"object store keep their manifest in {MANIFEST_DIR}/: extend it locally")
            loc.filesystem.create_dir(loc.path, recursive=True)
        manifest = read(loc)
        _check_identity(run_dir, manifest, header)
        if loc.local:
            writer = cls(run_dir / MANIFEST)
            with open(writer.path, "ab") as f:
                f.truncate(manifest.committed_bytes)
        else:
            entries = [n for n in loc.names(MANIFEST_DIR) if ENTRY.fullmatch(n)]
            writer = ObjectManifestWriter(loc, int(entries[-1][:10]) + 1 if entries else 0)
        if manifest.header is None:
            writer._append({"kind": "header", **header})
        return writer, manifest

    def commit(self, info: ShardInfo) -> None:
        """The commit point of a shard: one fsynced manifest line (object store: one entry object)."""
        self._append({"kind": "shard", **dataclasses.asdict(info)})

    def complete(self, record: dict) -> None:
        self._append({"kind": "complete", **record})

    def dataset(self, manifest: Manifest, ref: dict) -> None:
        """Record the dataset a run reads, once (see :func:`check_dataset`)."""
        if check_dataset(manifest, ref):
            self._append({"kind": "dataset", "dataset": ref})

    def _append(self, entry: dict) -> None:
        with open(self.path, "ab") as f:
            f.write(json.dumps(entry, sort_keys=True).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())


class ObjectManifestWriter(ManifestWriter):
    """The manifest of a run on an object store: entry ``seq`` is the object
    ``manifest.d/<seq:010d>-<kind>.json``, written whole (the commit is its close). Not safe for two
    writers: the driver is the only one."""

    def __init__(self, loc: Location, next_seq: int):
        super().__init__(PurePosixPath(loc.join(MANIFEST_DIR)))
        self.loc, self.seq = loc, next_seq

    def _append(self, entry: dict) -> None:
        name = f"{MANIFEST_DIR}/{self.seq:010d}-{entry['kind']}.json"
        self.loc.write_bytes(name, json.dumps(entry, sort_keys=True).encode() + b"\n")
        self.seq += 1


def _check_identity(run_dir, manifest: Manifest, header: dict) -> None:
    """Raise CaptureError when ``manifest`` holds a run whose identity differs from ``header``."""
    if manifest.header is None:
        return
    diff = identity_diff(manifest.header, header)
    if diff:
        detail = "; ".join(_change(k, manifest.header.get(k, IDENTITY_DEFAULTS.get(k)),
                                   header.get(k, IDENTITY_DEFAULTS.get(k))) for k in diff)
        raise CaptureError(f"{run_dir} holds a run with a different {', '.join(diff)} ({detail}); use another --out")


def _change(key: str, old, new) -> str:
    """``key: old → new``; for two mappings only the entries that differ (``responses.seed: 0 → 3``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return "; ".join(f"{key}.{k}: {_short(old.get(k))} → {_short(new.get(k))}"
                         for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))
    return f"{key}: {_short(old)} → {_short(new)}"


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def garbage(run_dir: str | os.PathLike | Location, manifest: Manifest | None = None) -> list[PurePath]:
    """Shard files in ``run_dir`` that no manifest line names: temporary files of an interrupted write
    and shards closed but never committed. They are not part of the run; ``capture shards gc`` removes
    them. Only names the shard writer makes count (``shard-*.arrow``, ``.tmp-shard-*.arrow``). Local
    runs give ``Path``s; runs on an object store give the objects' paths on its file system."""
    from shards.writer import TMP_PREFIX

    loc = as_location(run_dir)
    manifest = manifest or read(loc)
    named = {s["path"] for s in manifest.shards}
    if not loc.local:
        return [PurePosixPath(loc.join(n)) for n in loc.names() if n not in named and n.endswith(".arrow")
                and n.removeprefix(TMP_PREFIX).startswith("shard-")]
    run_dir = Path(loc.path)
    return sorted(p for p in run_dir.iterdir() if p.name not in named and p.suffix == ".arrow"
                  and p.name.removeprefix(TMP_PREFIX).startswith("shard-"))


def remove(run_dir: str | os.PathLike | Location, files: list[PurePath]) -> None:
    """Delete :func:`garbage` files of ``run_dir`` (one already gone is fine)."""
    loc = as_location(run_dir)
    for path in files:
        if loc.local:
            Path(path).unlink(missing_ok=True)
        else:
            loc.delete(path.name)


def lock_object(loc: Location) -> None:
    """Mark a run on an object store as being written: the object ``.capture.lock`` (host, pid, start).
    Advisory (an object store has no atomic create-if-absent): it makes a second ``capture run`` and
    ``capture shards gc`` refuse while a capture writes. Raises CaptureError when it exists already;
    a killed capture leaves it behind, and the message says how to remove it."""
    import socket
    import time

    if loc.exists(LOCK):
        raise CaptureError(f"another capture is writing to {loc.path}, or one was killed ({loc.join(LOCK)} exists); "
                           f"if none runs, delete {loc.join(LOCK)} and rerun")
    loc.write_bytes(LOCK, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                      "start": time.time()}).encode() + b"\n")


def gc(run_dir: str | os.PathLike | Location, dry_run: bool = False) -> list[PurePath]:
    """Remove :func:`garbage` files. Refuses (CaptureError) a folder without a run header, and a run
    that a capture is writing right now (its lock is held; object store: its lock object exists): its
    closed shards await their commit."""
    from filelock import FileLock, Timeout

    loc = as_location(run_dir)
    if read(loc).header is None:
        kind = MANIFEST if loc.local else f"{MANIFEST_DIR}/"
        raise CaptureError(f"{loc.path} holds no capture run ({kind} with a header); nothing removed")
    if not loc.local:
        if loc.exists(LOCK):
            raise CaptureError(f"a capture is writing to {loc.path} right now ({loc.join(LOCK)} exists); "
                               "run gc after it ends (a killed capture: delete that object first)")
        files = garbage(loc)
        if not dry_run:
            remove(loc, files)
        return files
    run_dir = Path(loc.path)
    lock = FileLock(run_dir / LOCK)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise CaptureError(f"a capture is writing to {run_dir} right now; run gc after it ends") from None
    try:
        files = garbage(run_dir)
        if not dry_run:
            for path in files:
                path.unlink()
        return files
    finally:
        lock.release()
