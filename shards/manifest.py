"""The manifest: ``manifest.jsonl`` in the run folder, the run's only commit log.

Line 1 is the run header (``{"kind": "header", ...}``, see :func:`shards.format.header`). Each shard is
committed by appending one ``{"kind": "shard", ...}`` line (path, rows, tokens, loss tokens, bytes,
sha256, sample ids, token hashes) with an fsync: a shard file no line names is not part of the run.
A finished run appends ``{"kind": "complete", ...}`` (counts by reason, end time); a resumed or extended
run appends more shard lines and another completion record. A run captured with ``--retain N`` (tail mode
with bounded disk, :mod:`shards.retain`) appends ``{"kind": "removed", "paths": [...], "reason": ...}``
before it deletes shards every reader has consumed: those rows stay committed (a resume does not redo
them; they count in the run's rows), but their files are gone and no reader, ``verify`` or ``audit``
looks for them. ``capture shards repair`` (:mod:`shards.repair`) appends ``{"kind": "lost", "paths": [...],
"reasons": [...]}`` for committed shards found damaged or missing: their lines stay (the history) but
they no longer count at all, so the same ``capture run`` captures their rows again. A line torn by a crash (no trailing newline)
is not committed: readers ignore it and the next writer cuts it off before appending.

Outside a local folder (an object store, see :mod:`shards.run`) nothing can be appended, and rewriting one
manifest object per commit would be quadratic, so the same log is one small object per entry:
``manifest.d/<seq:010d>-<kind>.json``, each holding exactly one manifest line, numbered from 0 in commit
order (header first). An entry object is written whole and appears at once when closed, so writing it is
the commit; there is no torn tail. The driver is the run's only writer and numbers the entries; readers
list ``manifest.d/``, sort the names and parse the lines as one ``manifest.jsonl`` (:meth:`shards.run.Location.read_manifest`).
An object store has no lock: a capture marks the run with a ``.capture.lock`` object (:func:`lock_object`),
which is advisory (two captures started at the same instant are not told apart). Where each of these
lives is :mod:`shards.run`'s business; this module knows what the lines mean.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os

from common.errors import CaptureError
from shards.format import FormatError, RunHeader
from shards.run import MANIFEST, Location, ManifestLog, as_location, plain_name
from shards.writer import ShardInfo

log = logging.getLogger(__name__)

REQUIRED = {  # keys each kind of line must have
    "header": ("format_version", "columns", "hidden_size", "codec"),
    "shard": ("path", "rows", "tokens", "loss_tokens", "bytes", "sha256", "sample_ids", "token_sha256"),
    "dataset": ("dataset",),
    "complete": (),
    "removed": ("paths", "reason"),
    "lost": ("paths", "reasons"),
}


@dataclasses.dataclass
class Manifest:
    """A parsed manifest. ``committed_bytes``: length of its complete lines (a torn tail lies beyond).

    ``shards``: the committed shards whose files the run still holds, in commit order (what every reader
    reads); ``removed``: the committed shards deleted after their readers consumed them (``--retain``),
    path → shard line; ``all_shards``: both, in commit order (what a tail-mode reader's order is made of).
    ``rows``, ``tokens``, :meth:`sample_ids` and :meth:`token_hashes` count every committed shard, removed
    ones too: their rows were captured once and a resume must not capture them again. ``lost``: shards
    given up by ``capture shards repair`` (path → shard line, with ``lost_reason``), in none of the above:
    their rows are for a resume to capture again.
    """

    header: RunHeader | None
    all_shards: list[dict]
    completions: list[dict]
    committed_bytes: int
    last_kind: str | None = None
    datasets: list[dict] = dataclasses.field(default_factory=list)  # every dataset the run has read
    removals: list[dict] = dataclasses.field(default_factory=list)  # the "removed" lines, in order
    lost: dict[str, dict] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def removed(self) -> dict[str, dict]:
        gone = {p for r in self.removals for p in r["paths"]}
        return {s["path"]: s for s in self.all_shards if s["path"] in gone}

    @functools.cached_property
    def shards(self) -> list[dict]:
        return [s for s in self.all_shards if s["path"] not in self.removed]

    @property
    def complete(self) -> bool:
        """True when the last committed line is a completion record (nothing was appended since)."""
        return self.last_kind == "complete"

    def sample_ids(self) -> set[str]:
        return {s for shard in self.all_shards for s in shard["sample_ids"]}

    def token_hashes(self) -> set[str]:
        return {h for shard in self.all_shards for h in shard["token_sha256"]}

    @property
    def rows(self) -> int:
        return sum(s["rows"] for s in self.all_shards)

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.all_shards)


def read(run: str | os.PathLike | Location) -> Manifest:
    """Parse the manifest of ``run`` (a path, a URI or a Location; ``manifest.jsonl``, or on an object
    store its ``manifest.d/``); a missing manifest gives an empty Manifest.

    Raises CaptureError for a corrupt line in the middle (only the last line may be torn), a header
    line that lacks a field, or an unknown major format version.
    """
    data, name = as_location(run).read_manifest()
    return parse(data, name)


def parse(data: bytes, path: str = MANIFEST) -> Manifest:
    """Parse the bytes of a manifest (read from any file system); ``path`` names it in errors.
    Raises CaptureError as :func:`read` does."""
    end = data.rfind(b"\n") + 1  # everything after the last newline is a torn, uncommitted line
    header, shards, completions, datasets, removals, lost = None, [], [], [], [], {}
    kind = None
    for i, line in enumerate(data[:end].splitlines()):
        try:
            entry = json.loads(line)
        except ValueError:  # json.JSONDecodeError, or UnicodeDecodeError for bytes that are no text
            raise CaptureError(f"{path}: line {i + 1} is not valid JSON; the manifest is damaged") from None
        kind = entry.get("kind") if isinstance(entry, dict) else None
        missing = [k for k in REQUIRED.get(kind, ("kind",)) if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise CaptureError(f"{path}: line {i + 1} lacks {', '.join(missing)}; the manifest is damaged")
        if kind == "header":
            try:
                header = RunHeader.from_dict(entry)
            except FormatError as e:
                raise FormatError(f"{path}: line {i + 1}: {e}") from None
        elif kind == "shard":
            shards.append(_checked_shard(entry, f"{path}: line {i + 1}"))
        elif kind == "dataset":
            datasets.append(entry["dataset"])
        elif kind == "complete":
            completions.append(entry)
        elif kind == "removed":
            if not isinstance(entry["paths"], list) or not all(map(plain_name, entry["paths"])):
                raise CaptureError(f"{path}: line {i + 1}: removed paths {_short(entry['paths'])} are not plain file "
                                   "names inside the run; the manifest is damaged or crafted")
            removals.append(entry)
        elif kind == "lost":
            if not (isinstance(entry["paths"], list) and all(map(plain_name, entry["paths"]))
                    and isinstance(entry["reasons"], list) and len(entry["reasons"]) == len(entry["paths"])):
                raise CaptureError(f"{path}: line {i + 1}: lost paths {_short(entry['paths'])} are not plain file names "
                                   "inside the run, one reason each; the manifest is damaged or crafted")
            lines = {s["path"]: s for s in shards}
            lost.update({p: {**lines[p], "lost_reason": r} for p, r in zip(entry["paths"], entry["reasons"]) if p in lines})
            shards = [s for s in shards if s["path"] not in lost]
    return Manifest(header, shards, completions, end, kind, datasets, removals, lost)


def _checked_shard(entry: dict, where: str) -> dict:
    """``entry`` (a shard line) when its ``path`` is a plain file name in the run folder and its counts
    agree (``rows`` = number of ``sample_ids`` = number of ``token_sha256``, non-negative integers);
    else CaptureError naming ``where``. Runs get shared and downloaded: a line naming
    ``../other-run/shard-….arrow`` must not make a reader open, or retention delete, a file elsewhere."""
    if not plain_name(entry["path"]):
        raise CaptureError(f"{where}: shard path {_short(entry['path'])} is not a plain file name inside the run; "
                           "the manifest is damaged or crafted")
    ids, hashes = entry["sample_ids"], entry["token_sha256"]
    counts = [entry[k] for k in ("rows", "tokens", "loss_tokens", "bytes")]
    if not (all(type(c) is int and c >= 0 for c in counts) and isinstance(ids, list) and isinstance(hashes, list)
            and entry["rows"] == len(ids) == len(hashes)):
        listed = {k: len(v) if isinstance(v, list) else _short(v) for k, v in (("sample ids", ids), ("token hashes", hashes))}
        raise CaptureError(f"{where}: shard {entry['path']} records rows {_short(entry['rows'])}, "
                           + ", ".join(f"{n} {k}" for k, n in listed.items())
                           + " (counts must be non-negative integers that agree); the manifest is damaged or crafted")
    return entry


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
    """Appends commits to a run's manifest. Open with :meth:`open`; only the driver (or recode) holds one."""

    def __init__(self, log_: ManifestLog):
        self.log = log_

    @classmethod
    def open(cls, run: str | os.PathLike | Location, header: RunHeader) -> tuple["ManifestWriter", Manifest]:
        """Create the run folder and manifest, or reopen an existing run with the same identity.

        Raises CaptureError when the existing run was made with a different target, taps, codec,
        template or tokenizer (the message lists the fields and both values).
        """
        loc = as_location(run)
        loc.create()
        manifest = read(loc)
        if manifest.header is not None and manifest.header.identity_diff(header) and holds_nothing(loc, manifest):
            log.warning("%s: the run there holds no rows yet (it was started with another %s and stopped before "
                        "its first commit); starting it again with these settings", loc.path,
                        ", ".join(manifest.header.identity_diff(header)))
            reset(loc)
            manifest = read(loc)
        check_identity(loc.path, manifest, header)
        writer = cls(loc.manifest_log(manifest.committed_bytes))
        if manifest.header is None:
            writer.log.append({"kind": "header", **header.to_dict()})
        return writer, manifest

    def commit(self, info: ShardInfo) -> None:
        """The commit point of a shard: one fsynced manifest line (object store: one entry object)."""
        self.log.append({"kind": "shard", **dataclasses.asdict(info)})

    def complete(self, record: dict) -> None:
        self.log.append({"kind": "complete", **record})

    def lost(self, paths: list[str], reasons: list[str]) -> None:
        """Record that the committed shards ``paths`` are damaged or missing (``reasons``, one each) and given
        up: their rows no longer count as committed (before their files are deleted, as :meth:`removed`)."""
        self.log.append({"kind": "lost", "paths": list(paths), "reasons": list(reasons)})

    def removed(self, paths: list[str], reason: str) -> None:
        """Record that the shards ``paths`` are about to be deleted and why (before deleting them: a crash
        in between leaves files no live line names, which ``gc`` removes, never a line naming a missing file)."""
        self.log.append({"kind": "removed", "paths": list(paths), "reason": reason})

    def dataset(self, manifest: Manifest, ref: dict) -> None:
        """Record the dataset a run reads, once (see :func:`check_dataset`)."""
        if check_dataset(manifest, ref):
            self.log.append({"kind": "dataset", "dataset": ref})


def holds_nothing(loc: Location, manifest: Manifest) -> bool:
    """Whether the run at ``loc`` has nothing to keep: no shard line, no removal, no completion record
    and no reader's ack (e.g. a run whose engine failed to start after its header was written)."""
    from shards import live  # live imports run, as this module does; lazy keeps the import light

    return not (manifest.all_shards or manifest.removals or manifest.lost or manifest.completions
                or live.any_acks(loc))


def reset(loc: Location) -> None:
    """Remove the manifest of a run that :func:`holds_nothing` (its header and dataset lines)."""
    loc.delete_manifest()


def check_identity(run: str, manifest: Manifest, header: RunHeader) -> None:
    """Raise CaptureError when ``manifest`` holds a run whose identity differs from ``header``."""
    if manifest.header is None:
        return
    diff = manifest.header.identity_diff(header)
    if diff:
        old, new = manifest.header.identity(), header.identity()
        detail = "; ".join(_change(k, old[k], new[k]) for k in diff)
        raise CaptureError(f"{run} holds a run with a different {', '.join(diff)} ({detail}); use another --out")


def _change(key: str, old, new) -> str:
    """``key: old → new``; for two mappings only the entries that differ (``responses.seed: 0 → 3``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return "; ".join(f"{key}.{k}: {_short(old.get(k))} → {_short(new.get(k))}"
                         for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))
    return f"{key}: {_short(old)} → {_short(new)}"


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def garbage(run: str | os.PathLike | Location, manifest: Manifest | None = None) -> list[str]:
    """Names of the shard files in the run folder that no manifest line names: temporary files of an
    interrupted write and shards closed but never committed. They are not part of the run;
    ``capture shards gc`` removes them."""
    loc = as_location(run)
    manifest = manifest or read(loc)
    return loc.garbage({s["path"] for s in manifest.shards})


def remove(run: str | os.PathLike | Location, names: list[str]) -> None:
    """Delete :func:`garbage` files of ``run`` (one already gone is fine)."""
    loc = as_location(run)
    for name in names:
        loc.delete(name)


def gc(run: str | os.PathLike | Location, dry_run: bool = False) -> list[str]:
    """Remove :func:`garbage` files; returns their names. Refuses (CaptureError) a folder without a run
    header, and a run that a capture is writing right now (its lock is held): its closed shards await
    their commit."""
    loc = as_location(run)
    if read(loc).header is None:
        raise CaptureError(f"{loc.path} holds no capture run ({loc.manifest_name} with a header); nothing removed")
    with loc.lock(busy=f"a capture is writing to {loc.path} right now; run gc after it ends"):
        files = garbage(loc)
        if not dry_run:
            remove(loc, files)
        return files
