"""One invocation's hold on a run: the manifest writer, provenance and the summary, under the run lock.

:meth:`RunSession.open` writes the header and dataset lines (a resumed run keeps the cell layout of the
format version that started it) and starts this invocation in ``provenance.json``; :meth:`commit`
appends one manifest line per shard (the only commit, :mod:`shards.manifest`); :meth:`finish` ends the
invocation: a clean stop (nothing half-written: CaptureError naming why), or the removal of uncommitted
files, the ``--self-check`` and the completion record.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import provenance
from capture.config import RunConfig
from capture.engines import EngineSpec
from capture.plan import Prepared, filter_settings
from capture.progress import Progress, Timings
from capture.summary import Summary
from common.errors import CaptureError
from shards import manifest as manifest_mod
from shards.run import Location

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunSession:
    """``writer``: the run's :class:`shards.manifest.ManifestWriter`; ``record``: this invocation's
    provenance; ``summary``: what this invocation did, filled as it goes."""

    cfg: RunConfig
    prep: Prepared
    loc: Location
    writer: manifest_mod.ManifestWriter
    manifest: manifest_mod.Manifest  # as it was when the session opened
    record: dict
    summary: Summary
    timings: Timings
    started: float

    @classmethod
    def open(cls, cfg: RunConfig, prep: Prepared, loc: Location, started: float, timings: Timings,
             executor: str) -> "RunSession":
        """Write the run header and dataset lines and start provenance. Raises CaptureError when the
        manifest or provenance cannot be written, or less than ``cfg.disk_reserve`` is free."""
        try:
            writer, manifest = manifest_mod.ManifestWriter.open(loc, prep.header)
            writer.dataset(manifest, dataclasses.asdict(prep.dataset))
        except OSError as e:
            raise CaptureError(f"cannot write the manifest in {cfg.out}: {e.strerror or e}") from None
        if manifest.header is not None:  # a resumed run keeps the cell layout of the version that started it
            prep = dataclasses.replace(prep, header=prep.header.replace(format_version=manifest.header.format_version))
        garbage = manifest_mod.garbage(loc, manifest)
        if garbage:
            log.warning("%s: %d uncommitted file(s) from an interrupted run are ignored (removed when this run "
                        "completes)", cfg.out, len(garbage))
        free = loc.free_bytes()  # None on an object store
        if free is not None and free < cfg.disk_reserve:
            raise CaptureError(f"only {free / 2**20:.0f} MiB free at {cfg.out}; free some space first")
        try:
            record = provenance.start(loc, header=prep.header, model_dir=prep.model_dir,
                                      dataset=dataclasses.asdict(prep.dataset), filters=filter_settings(cfg),
                                      started=started)
        except OSError as e:
            raise CaptureError(f"cannot write {provenance.PROVENANCE} in {cfg.out}: {e.strerror or e}") from None
        summary = Summary(out=cfg.out, executor=executor, engine=prep.engine_choice)
        return cls(cfg, prep, loc, writer, manifest, record, summary, timings, started)

    def commit(self, infos: Sequence) -> None:
        """Commit the shards a replica closed: one manifest line each (:class:`shards.writer.ShardInfo`)."""
        t0 = time.perf_counter()
        for info in infos:
            self.writer.commit(info)
            self.summary.shards += 1
            self.summary.committed_bytes += info.bytes
            self.count(info)
        self.timings.commit += time.perf_counter() - t0

    def count(self, info) -> None:
        """Count ``info``'s rows as committed by this invocation (a shard's, or an online delivery's)."""
        self.summary.committed_rows += info.rows
        self.summary.committed_tokens += info.tokens
        self.summary.committed_loss_tokens += info.loss_tokens

    def finish(self, stop: str | None, progress: Progress, sink) -> Summary:
        """End the invocation. ``stop``: why the run stopped early (a full disk): provenance says
        ``stopped`` and CaptureError says what stays committed. Else uncommitted files are removed, the
        self-check runs, and the completion record is written; CaptureError when no row at all is in the
        run. ``sink``: its ``name`` goes in the completion record; a sink without shards (online delivery)
        counts the run's totals from what it delivered."""
        cfg, summary = self.cfg, self.summary
        manifest_now = manifest_mod.read(self.loc)
        summary.total_rows, summary.total_tokens = manifest_now.rows, manifest_now.tokens
        if not sink.output.shards:  # online: what this run delivered and what earlier runs' trainers acked
            summary.total_rows = summary.committed_rows + summary.already_committed
            summary.total_tokens = summary.committed_tokens
        summary.seconds = round(time.time() - self.started, 2)
        ended = time.time()
        if stop:
            self._finish_provenance(summary, "stopped", ended)
            raise CaptureError(
                f"stopped cleanly: {stop}; {summary.shards} shard(s) committed in this run, nothing half-written. "
                "Free some space and rerun the same command to resume"
            )
        removed = manifest_mod.garbage(self.loc)  # every replica has finished and the run lock is held
        manifest_mod.remove(self.loc, removed)
        if removed:
            log.info("removed %d uncommitted shard file(s) left by failed replicas or interrupted runs", len(removed))
        summary.self_check = self._self_check(progress) if manifest_now.shards else None
        self.writer.complete({
            "end_time": provenance.record.utc_now(ended),
            "dataset": dataclasses.asdict(self.prep.dataset),
            "limit": cfg.limit,
            "rows_read": summary.rows_read,
            "committed_rows": summary.committed_rows,
            "already_committed": summary.already_committed,
            "skipped": summary.skipped,
            "rejected": summary.rejected,
            "quarantined": summary.quarantined,
            "replicas": summary.replicas,
            "normalized": summary.normalized,
            "truncated_input": summary.truncated_input,
            "total_rows": summary.total_rows,
            "total_tokens": summary.total_tokens,
            "self_check": summary.self_check,
            **({"retained": summary.retained} if summary.retained else {}),
            **({"online": sink.name} if sink.name else {}),  # deliver: committed = delivered; tee: shards too
        })
        self._finish_provenance(summary, "complete", ended)
        if summary.total_rows == 0:
            reasons = {**summary.skipped, **summary.rejected}
            detail = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])) or "no rows read"
            raise CaptureError(f"no records written: all {summary.rows_read} rows read were dropped ({detail})")
        return summary

    def _self_check(self, progress: Progress) -> dict | None:
        """Run :func:`provenance.check.check` on the committed run (``--self-check N`` rows); its verdict,
        also added to this invocation in ``provenance.json``."""
        n = self_check_rows(self.cfg, self.prep.engine)
        if not n:
            return None
        from provenance.check import check

        progress.status(f"self-check: {n} rows against a float32 HF forward")
        try:
            report = check(self.loc, rows=n, model_path=self.prep.model_dir)
            verdict = {"rows": len(report.rows), "tokens": report.tokens, "dtype": report.dtype, "ok": report.ok,
                       "problems": report.problems, "argmax_agreement": report.argmax_agreement,
                       "topk_overlap": report.topk_overlap,
                       "taps": {t.column: {"cos_min": round(t.cos_min, 6), "cos_mean": round(t.cos_mean, 6),
                                           "rel_err": round(t.rel_err, 6)} for t in report.taps}}
        except Exception as e:  # noqa: BLE001 - the rows stay committed; a check that cannot run is a failed check
            reason = f"the check could not run: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            verdict = {"rows": 0, "ok": False, "problems": [reason]}
        self.record["invocations"][-1]["self_check"] = verdict
        if not verdict["ok"]:
            log.error("self-check FAILED on %s: %s", self.cfg.out, "; ".join(verdict["problems"]))
        return verdict

    def _finish_provenance(self, summary: Summary, status: str, ended: float) -> None:
        try:
            provenance.finish(self.loc, self.record, status=status, rows_read=summary.rows_read,
                              rows_committed=summary.committed_rows, shards_committed=summary.shards, ended=ended)
        except OSError as e:  # a full disk: the shards and the manifest are what counts
            log.warning("cannot update %s in %s: %s", provenance.PROVENANCE, self.loc.path, e.strerror or e)


def self_check_rows(cfg: RunConfig, engine: EngineSpec) -> int:
    """``--self-check``'s row count: as given, else the engine's ``Capabilities.self_check`` (8 for vllm,
    whose states come from code paths other than a plain HF forward; 0 for hf, and for exl3, whose EXL3
    weights transformers cannot load: check such a run with ``capture shards check --model-path`` the
    unquantized folder)."""
    return cfg.self_check if cfg.self_check is not None else engine.capabilities.self_check
