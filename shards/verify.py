"""``capture shards verify``: recheck every committed shard against the manifest.

Per shard: the file exists, its size and SHA-256 equal the manifest line, its schema header has the
run's identity, its rows, sample ids, tokens and supervised tokens equal the manifest's, and every row is
self-consistent (``num_tokens`` = len(input_ids) = len(loss_mask) = len(argmax), ``num_loss_tokens`` =
sum(loss_mask), every state cell decodes to ``[T, H]``, ``token_sha256`` recomputes, ``finish_reasons``
fits the run's responses mode). Across shards: no sample id twice. Files in the folder that no manifest
line names are reported as garbage, not errors. A run on an object store (a URI, see :mod:`shards.fs`)
is read through its file system.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import zstandard

from capture.errors import CaptureError
from capture.hashing import sha256_file, token_sha256
from shards import manifest as manifest_mod
from shards.fs import Location, as_location
from shards.format import STATE_TYPE, FormatError, read_header
from shards.manifest import identity_diff
from shards.reader import read_table, state_tensor


@dataclasses.dataclass
class Report:
    shards: int = 0
    rows: int = 0
    tokens: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    garbage: list[str] = dataclasses.field(default_factory=list)
    complete: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclasses.dataclass(frozen=True)
class FileMismatch:
    """A file that is not what a record says: ``field`` is ``missing``, ``bytes`` or ``sha256``;
    ``expected``/``actual`` are the recorded and the found values (sizes in bytes, hashes as hex)."""

    path: str
    field: str
    expected: str | int | None
    actual: str | int | None


def check_file(path: str | os.PathLike, size: int, sha256: str) -> FileMismatch | None:
    """Recheck one file against its recorded size (bytes) and SHA-256 (hex), hashing it streamed.
    Returns None when both match, else the first difference; never raises for a missing file."""
    path = Path(path)
    if not path.is_file():
        return FileMismatch(str(path), "missing", size, None)
    found = path.stat().st_size
    if found != size:
        return FileMismatch(str(path), "bytes", size, found)
    digest = sha256_file(path)
    if digest != sha256:
        return FileMismatch(str(path), "sha256", sha256, digest)
    return None


def check_object(loc: Location, name: str, size: int, sha256: str) -> FileMismatch | None:
    """:func:`check_file` for the object ``name`` of a run on any file system (streamed, 1 MiB reads)."""
    path = loc.join(name)
    info = loc.filesystem.get_file_info(path)
    if info.type != pafs.FileType.File:
        return FileMismatch(path, "missing", size, None)
    if info.size != size:
        return FileMismatch(path, "bytes", size, info.size)
    sha = hashlib.sha256()
    with loc.filesystem.open_input_stream(path) as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    if sha.hexdigest() != sha256:
        return FileMismatch(path, "sha256", sha256, sha.hexdigest())
    return None


def verify(run_dir: str | os.PathLike | Location) -> Report:
    """Check the run in ``run_dir`` (a path, a URI or a Location); problems are listed, never raised (a
    missing manifest is one)."""
    loc = as_location(run_dir)
    run_dir = Path(loc.path) if loc.local else loc.path
    report = Report()
    try:
        m = manifest_mod.read(loc)
    except CaptureError as e:  # a damaged manifest is a finding, like a damaged shard
        report.problems.append(str(e))
        return report
    if m.header is None:
        kind = manifest_mod.MANIFEST if loc.local else f"{manifest_mod.MANIFEST_DIR}/"
        report.problems.append(f"{run_dir}: no manifest with a header ({kind})")
        return report
    report.complete = m.complete
    seen: set[str] = set()
    for entry in m.shards:
        report.shards += 1
        problems = _verify_shard(loc, entry, m.header)
        report.problems += [f"{entry['path']}: {p}" for p in problems]
        dups = seen.intersection(entry["sample_ids"])
        if dups:
            report.problems.append(f"{entry['path']}: {len(dups)} sample id(s) already committed, e.g. {min(dups)}")
        seen.update(entry["sample_ids"])
        report.rows += entry["rows"]
        report.tokens += entry["tokens"]
    report.garbage = [p.name for p in manifest_mod.garbage(loc, m)]
    return report


def _check_finish_reasons(reasons: list, header: dict, ids: list[str]) -> list[str]:
    """Regenerate runs: one reason or more per row, each ``stop`` or ``length``, all but the last ``stop``
    (a conversation goes on only after an answer that stopped); dataset runs: null."""
    if (header.get("responses") or {}).get("mode") == "regenerate":
        bad = [i for i, r in enumerate(reasons)
               if not r or r[-1] not in ("stop", "length") or any(x != "stop" for x in r[:-1])]
        want = "one 'stop'/'length' per generated turn"
    else:
        bad = [i for i, r in enumerate(reasons) if r is not None]
        want = "null (the answers come from the dataset)"
    return [f"finish_reasons not {want} in {len(bad)} row(s), e.g. {ids[bad[0]]}"] if bad else []


def _verify_shard(loc: Location, entry: dict, header: dict) -> list[str]:
    if loc.local:
        path, filesystem = Path(loc.path) / entry["path"], None
        bad = check_file(path, entry["bytes"], entry["sha256"])
    else:
        path, filesystem = loc.join(entry["path"]), loc.filesystem
        bad = check_object(loc, entry["path"], entry["bytes"], entry["sha256"])
    if bad is not None:
        if bad.field == "missing":
            return ["missing"]
        if bad.field == "bytes":
            return [f"size {bad.actual} != manifest {bad.expected}"]
        return [f"sha256 {bad.actual[:16]}… != manifest {bad.expected[:16]}…"]
    try:
        table = read_table(path, filesystem=filesystem)
        diff = identity_diff(header, read_header(table.schema))
    except (pa.ArrowInvalid, FormatError) as e:
        return [f"unreadable: {e}"]
    problems = [f"schema header differs from the manifest in {', '.join(diff)}"] if diff else []
    if table.num_rows != entry["rows"]:
        problems.append(f"{table.num_rows} rows != manifest {entry['rows']}")
    ids = table.column("sample_id").to_pylist()
    if tuple(ids) != tuple(entry["sample_ids"]):
        problems.append("sample ids differ from the manifest")
    n = table.column("num_tokens").to_numpy()
    for column in ("input_ids", "loss_mask") + (("argmax",) if "argmax" in table.column_names else ()):
        lengths = pc.list_value_length(table.column(column)).to_numpy()
        if not np.array_equal(lengths, n):
            problems.append(f"{column} lengths differ from num_tokens in {int((lengths != n).sum())} row(s)")
    mask_sums = np.array([int(np.sum(v.values.to_numpy(zero_copy_only=False))) for v in table.column("loss_mask")])
    if not np.array_equal(mask_sums, table.column("num_loss_tokens").to_numpy()):
        problems.append("num_loss_tokens differs from sum(loss_mask)")
    if "finish_reasons" in table.column_names:
        problems += _check_finish_reasons(table.column("finish_reasons").to_pylist(), header, ids)
    if int(n.sum()) != entry["tokens"] or int(mask_sums.sum()) != entry["loss_tokens"]:
        problems.append(f"tokens {int(n.sum())}/{int(mask_sums.sum())} != manifest {entry['tokens']}/{entry['loss_tokens']}")
    for field in table.schema:
        if field.type == STATE_TYPE:
            bad = []
            for i in range(table.num_rows):
                try:
                    state_tensor(table, field.name, i)
                except (ValueError, RuntimeError, zstandard.ZstdError):
                    bad.append(i)
            if bad:
                problems.append(f"{field.name}: {len(bad)} row(s) do not decode to [T, H], e.g. {ids[bad[0]]}")
    hashes = [token_sha256(v.values.to_numpy()) for v in table.column("input_ids")]
    bad = [i for i, (a, b) in enumerate(zip(hashes, table.column("token_sha256").to_pylist())) if a != b]
    if bad:
        problems.append(f"token_sha256 mismatch in {len(bad)} row(s), e.g. {ids[bad[0]]}")
    return problems
