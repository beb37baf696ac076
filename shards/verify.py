"""``capture shards verify``: recheck every committed shard against the manifest.

Per shard: the file exists, its size and SHA-256 equal the manifest line, its schema header has the
run's identity, its rows, sample ids, tokens and supervised tokens equal the manifest's, and every row is
self-consistent (``num_tokens`` = len(input_ids) = len(loss_mask) = len(argmax), ``num_loss_tokens`` =
sum(loss_mask), every state cell decodes to ``[T, H]``, ``token_sha256`` recomputes, ``finish_reasons``
fits the run's responses mode; a ``--topk K`` run: both top-K cells decode to ``[T, K]``, ids are
non-negative and distinct within a position, log-probabilities hold no NaN or +inf and do not increase
along K). Across shards: no sample id twice (removed shards' ids included). Shards a ``--retain`` run
removed after every reader consumed them are counted, not checked (their files are gone by design). Files in the folder that no manifest
line names are reported as garbage, not errors. A run on an object store (a URI, see :mod:`shards.run`)
is read through its file system.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import zstandard

from common.errors import CaptureError
from common.hashing import token_sha256
from shards import manifest as manifest_mod
from shards.format import FormatError, RunHeader, read_header
from shards import topk as topk_mod
from shards.rows import state_columns, state_tensor, topk_arrays
from shards.run import Location, as_location


@dataclasses.dataclass
class Report:
    shards: int = 0
    rows: int = 0
    tokens: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    garbage: list[str] = dataclasses.field(default_factory=list)
    complete: bool = False
    removed_shards: int = 0  # committed shards deleted after their readers consumed them (--retain): not checked
    removed_rows: int = 0
    lost_shards: int = 0  # shards given up by `capture shards repair` (not committed any more): not checked
    lost_rows: int = 0
    readable: bool = True  # False: the manifest itself could not be read (the one problem listed)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(run_dir: str | os.PathLike | Location) -> Report:
    """Check the run in ``run_dir`` (a path, a URI or a Location); problems are listed, never raised (a
    missing manifest is one)."""
    loc = as_location(run_dir)
    report = Report()
    try:
        m = manifest_mod.read(loc)
    except CaptureError as e:  # a damaged manifest is a finding, like a damaged shard
        report.problems.append(str(e))
        report.readable = False
        return report
    if m.header is None:
        report.problems.append(f"{loc.path}: no manifest with a header ({loc.manifest_name})")
        return report
    report.complete = m.complete
    seen: set[str] = set()
    for entry in m.removed.values():  # their ids still count: a live shard must not repeat one
        report.removed_shards += 1
        report.removed_rows += entry["rows"]
        seen.update(entry["sample_ids"])
    report.lost_shards, report.lost_rows = len(m.lost), sum(s["rows"] for s in m.lost.values())
    for entry in m.shards:
        report.shards += 1
        problems = check_shard(loc, entry, m.header)
        report.problems += [f"{entry['path']}: {p}" for p in problems]
        dups = seen.intersection(entry["sample_ids"])
        if dups:
            report.problems.append(f"{entry['path']}: {len(dups)} sample id(s) already committed, e.g. {min(dups)}")
        seen.update(entry["sample_ids"])
        report.rows += entry["rows"]
        report.tokens += entry["tokens"]
    report.garbage = manifest_mod.garbage(loc, m)
    return report


def _check_finish_reasons(reasons: list, header: RunHeader, ids: list[str]) -> list[str]:
    """Regenerate runs: one reason or more per row, each ``stop`` or ``length``, all but the last ``stop``
    (a conversation goes on only after an answer that stopped); dataset runs: null."""
    if header.mode == "regenerate":
        bad = [i for i, r in enumerate(reasons)
               if not r or r[-1] not in ("stop", "length") or any(x != "stop" for x in r[:-1])]
        want = "one 'stop'/'length' per generated turn"
    else:
        bad = [i for i, r in enumerate(reasons) if r is not None]
        want = "null (the answers come from the dataset)"
    return [f"finish_reasons not {want} in {len(bad)} row(s), e.g. {ids[bad[0]]}"] if bad else []


def check_shard(loc: Location, entry: dict, header: RunHeader) -> list[str]:
    bad = loc.check_file(entry["path"], entry["bytes"], entry["sha256"])
    if bad is not None:
        if bad.field == "missing":
            return ["missing"]
        if bad.field == "bytes":
            return [f"size {bad.actual} != manifest {bad.expected}"]
        return [f"sha256 {bad.actual[:16]}… != manifest {bad.expected[:16]}…"]
    try:
        table = loc.read_table(entry["path"])
        diff = header.identity_diff(read_header(table.schema))
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
    for column in state_columns(table):
        bad = []
        for i in range(table.num_rows):
            try:
                state_tensor(table, column, i)
            except (ValueError, RuntimeError, zstandard.ZstdError):
                bad.append(i)
        if bad:
            problems.append(f"{column}: {len(bad)} row(s) do not decode to [T, H], e.g. {ids[bad[0]]}")
    problems += _check_topk(table, header, ids)
    hashes = [token_sha256(v.values.to_numpy()) for v in table.column("input_ids")]
    bad = [i for i, (a, b) in enumerate(zip(hashes, table.column("token_sha256").to_pylist())) if a != b]
    if bad:
        problems.append(f"token_sha256 mismatch in {len(bad)} row(s), e.g. {ids[bad[0]]}")
    return problems


def _check_topk(table: pa.Table, header: RunHeader, ids: list[str]) -> list[str]:
    """The top-K cells of a ``--topk K`` run (module docstring); none in a run without."""
    present = [c for c in topk_mod.COLUMNS if c in table.column_names]
    if not header.topk:
        return [f"top-K column(s) {present} in a run whose header has topk 0"] if present else []
    if len(present) != len(topk_mod.COLUMNS):
        return [f"no {', '.join(c for c in topk_mod.COLUMNS if c not in present)} column (header topk {header.topk})"]
    undecodable, bad = [], []
    for i in range(table.num_rows):
        try:
            top_ids, values = topk_arrays(table, i, header.topk)
        except (ValueError, zstandard.ZstdError):
            undecodable.append(i)
            continue
        ordered = np.sort(top_ids, axis=1)
        with np.errstate(invalid="ignore"):  # -inf - -inf (probability 0 twice) is NaN, not an increase
            rising = (np.diff(values, axis=1) > 0).any()
        if (top_ids < 0).any() or (ordered[:, 1:] == ordered[:, :-1]).any() or np.isnan(values).any() \
                or np.isposinf(values).any() or rising:
            bad.append(i)
    out = []
    if undecodable:
        out.append(f"top-K: {len(undecodable)} row(s) do not decode to [T, {header.topk}], e.g. {ids[undecodable[0]]}")
    if bad:
        out.append(f"top-K: {len(bad)} row(s) with negative or repeated ids, NaN/+inf or increasing log-probabilities, "
                   f"e.g. {ids[bad[0]]}")
    return out
