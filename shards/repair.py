"""``capture shards repair RUN``: give up committed shards that are damaged or missing, so that the same
``capture run`` captures exactly their rows again.

A shard truncated, bit-flipped (a SHA-256 other than its manifest line's) or deleted stops every rerun
(:func:`capture.plan.check_out`: "restore them first"), which is right while a copy exists and a dead end
when none does. Repair checks every live shard as ``capture shards verify`` does
(:func:`shards.verify.check_shard`), appends one ``lost`` manifest line naming the failing shards and
why (:meth:`shards.manifest.ManifestWriter.lost`; the shard lines stay, so the manifest keeps the
history), then deletes their files. From then on their rows are not committed: readers and ``verify``
skip the shards, and a resume captures their rows (only theirs, every other row is committed) into new
shards. Under the run lock: never beside a capture or another repair. Works on object stores (the line is
one more ``manifest.d/`` entry). Readers that are streaming the run at that moment lose their place (the
run's row order changes): repair a run nobody reads.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from common.errors import CaptureError
from shards import manifest as manifest_mod
from shards.run import Location, as_location
from shards.verify import check_shard

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Repair:
    """What :func:`repair` found: ``lost`` maps each given-up shard to its problems; ``rows`` is the number of
    rows they held (what the next ``capture run`` captures again); ``checked`` counts the live shards checked."""

    checked: int = 0
    lost: dict[str, str] = dataclasses.field(default_factory=dict)
    rows: int = 0


def repair(run: str | os.PathLike | Location, dry_run: bool = False) -> Repair:
    """Give up the damaged or missing committed shards of ``run`` (module docstring); ``dry_run`` only
    reports them. Raises CaptureError for a folder without a run, a run a capture is writing (its lock is
    held), or a manifest that cannot be read."""
    loc = as_location(run)
    if manifest_mod.read(loc).header is None:
        raise CaptureError(f"{loc.path} holds no capture run ({loc.manifest_name} with a header); nothing repaired")
    with loc.lock(busy=f"a capture is writing to {loc.path} right now; repair it after the capture ends"):
        m = manifest_mod.read(loc)  # again, under the lock
        report = Repair(checked=len(m.shards))
        for entry in m.shards:
            problems = check_shard(loc, entry, m.header)
            if problems:
                report.lost[entry["path"]] = "; ".join(problems)
                report.rows += entry["rows"]
        if report.lost and not dry_run:
            writer = manifest_mod.ManifestWriter(loc.manifest_log(m.committed_bytes))
            writer.lost(list(report.lost), list(report.lost.values()))  # the commit point, before any delete
            for name in report.lost:
                if loc.exists(name):
                    loc.delete(name)
            log.info("%s: %d damaged or missing shard(s) given up, %d row(s) to capture again",
                     loc.path, len(report.lost), report.rows)
        return report
