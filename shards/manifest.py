"""The manifest: ``manifest.jsonl`` in the run folder, the run's only commit log.

Line 1 is the run header (``{"kind": "header", ...}``, see :func:`shards.format.header`). Each shard is
committed by appending one ``{"kind": "shard", ...}`` line (path, rows, tokens, loss tokens, bytes,
sha256, sample ids, token hashes) with an fsync: a shard file no line names is not part of the run.
A finished run appends ``{"kind": "complete", ...}`` (counts by reason, end time); a resumed or extended
run appends more shard lines and another completion record. A line torn by a crash (no trailing newline)
is not committed: readers ignore it and the next writer cuts it off before appending.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from capture.errors import CaptureError
from shards.format import IDENTITY_DEFAULTS, RUN_IDENTITY, check_version
from shards.writer import ShardInfo

log = logging.getLogger(__name__)

MANIFEST = "manifest.jsonl"
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


def read(run_dir: str | os.PathLike) -> Manifest:
    """Parse ``run_dir/manifest.jsonl``; a missing file gives an empty Manifest.

    Raises CaptureError for a corrupt line in the middle (only the last line may be torn) or an unknown
    major format version.
    """
    path = Path(run_dir) / MANIFEST
    if not path.exists():
        return Manifest(None, [], [], 0)
    return parse(path.read_bytes(), str(path))


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
    def open(cls, run_dir: str | os.PathLike, header: dict) -> tuple["ManifestWriter", Manifest]:
        """Create the run folder and manifest, or reopen an existing run with the same identity.

        Raises CaptureError when the existing run was made with a different target, taps, codec,
        template or tokenizer (the message lists the fields and both values).
        """
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        manifest = read(run_dir)
        writer = cls(run_dir / MANIFEST)
        if manifest.header is not None:
            diff = identity_diff(manifest.header, header)
            if diff:
                detail = "; ".join(_change(k, manifest.header.get(k, IDENTITY_DEFAULTS.get(k)),
                                           header.get(k, IDENTITY_DEFAULTS.get(k))) for k in diff)
                raise CaptureError(
                    f"{run_dir} holds a run with a different {', '.join(diff)} ({detail}); use another --out"
                )
        with open(writer.path, "ab") as f:
            f.truncate(manifest.committed_bytes)
        if manifest.header is None:
            writer._append({"kind": "header", **header})
        return writer, manifest

    def commit(self, info: ShardInfo) -> None:
        """The commit point of a shard: one fsynced manifest line."""
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


def _change(key: str, old, new) -> str:
    """``key: old → new``; for two mappings only the entries that differ (``responses.seed: 0 → 3``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return "; ".join(f"{key}.{k}: {_short(old.get(k))} → {_short(new.get(k))}"
                         for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))
    return f"{key}: {_short(old)} → {_short(new)}"


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def garbage(run_dir: str | os.PathLike, manifest: Manifest | None = None) -> list[Path]:
    """Shard files in ``run_dir`` that no manifest line names: temporary files of an interrupted write
    and shards closed but never committed. They are not part of the run; ``capture shards gc`` removes
    them. Only names the shard writer makes count (``shard-*.arrow``, ``.tmp-shard-*.arrow``)."""
    from shards.writer import TMP_PREFIX

    run_dir = Path(run_dir)
    manifest = manifest or read(run_dir)
    named = {s["path"] for s in manifest.shards}
    return sorted(p for p in run_dir.iterdir() if p.name not in named and p.suffix == ".arrow"
                  and p.name.removeprefix(TMP_PREFIX).startswith("shard-"))


def gc(run_dir: str | os.PathLike, dry_run: bool = False) -> list[Path]:
    """Remove :func:`garbage` files. Refuses (CaptureError) a folder without a run header, and a run
    that a capture is writing right now (its lock is held): its closed shards await their commit."""
    from filelock import FileLock, Timeout

    run_dir = Path(run_dir)
    if read(run_dir).header is None:
        raise CaptureError(f"{run_dir} holds no capture run ({MANIFEST} with a header); nothing removed")
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
