"""The driver: dataset rows → conversations → tokens + loss mask → filters → work units → replicas.

Replicas are Ray actors (a local ``ray.init()`` unless ``ray_address`` is given); the driver streams the
dataset (never holding it), tokenizes and filters in order, hands work units of ~``unit_tokens`` tokens
to a :class:`capture.pool.ReplicaPool` (two units queued per replica; a replica that dies or hangs is
replaced and its uncommitted records handed out again), and commits every shard a replica
closes with one manifest line. Rerunning the same command resumes: sample ids already in the manifest
are skipped before tokenization, and the dedup filter is seeded with the committed token hashes.

A run stops cleanly (everything committed stays committed, no completion record) when the disk is about
to fill or fills; a run that keeps no record at all raises CaptureError with the counts by reason.

``--out`` may name a run on any file system pyarrow supports (:mod:`shards.fs`). On an object store
there is no rename and no append: shards are written under their final names, the manifest is one
object per entry, the run lock is an advisory ``.capture.lock`` object, and free space is not checked.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path

from capture.chat import ChatEncoder, Tokenized, load_encoder, packaged_template, tokenizer_sha256
from capture.config import RunConfig
from capture.engines import EngineSpec, engine_spec, vllm_engine_args
from capture.data import DatasetRef, ReadStats, iter_conversations, resolve_dataset
from capture.errors import CaptureError
from capture.pool import ReplicaPool
from capture.regenerate import responses_header
from capture.targets import Taps, Target, make_taps, model_dir, resolve_target
from filters import apply_filters, filter_prompt
import provenance
from shards import codecs
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards.fs import Location, resolve

log = logging.getLogger(__name__)



@dataclasses.dataclass
class Summary:
    """What a run did. Counts are for this invocation; ``total_*`` are the whole run's (manifest)."""

    out: str
    rows_read: int = 0
    already_committed: int = 0
    kept: int = 0  # records sent to the engine
    committed_rows: int = 0
    committed_tokens: int = 0
    committed_loss_tokens: int = 0
    committed_bytes: int = 0
    shards: int = 0
    skipped: dict = dataclasses.field(default_factory=dict)  # reason → rows (data, template, filters)
    rejected: dict = dataclasses.field(default_factory=dict)  # reason → rows (write-time validation)
    normalized: dict = dataclasses.field(default_factory=dict)
    truncated_input: str | None = None
    total_rows: int = 0
    total_tokens: int = 0
    seconds: float = 0.0
    estimated_bytes: int | None = None  # dry run only
    estimated_tokens: int | None = None  # dry run only
    estimated_bytes_by_codec: dict | None = None  # dry run only
    free_bytes: int | None = None  # dry run only: free space where --out is (or would be)
    replicas: list = dataclasses.field(default_factory=list)  # per replica: units, rows, tokens, busy s, restarts
    quarantined: dict = dataclasses.field(default_factory=dict)  # sample_id → reason (failed every attempt)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Prepared:
    target: Target
    taps: Taps
    model_dir: str
    encoder: ChatEncoder
    header: dict
    context_len: int | None
    dataset: DatasetRef
    engine: EngineSpec


def prepare(cfg: RunConfig) -> Prepared:
    """Resolve target, taps, dataset, model folder, tokenizer and run header (no engine loaded): every
    user error is raised here, before anything is written."""
    target = resolve_target(cfg.target)
    taps = make_taps(target, cfg.layers, cfg.final)
    dataset = resolve_dataset(cfg.dataset, cfg.split)
    mdir = model_dir(target, cfg.model_path)
    template_file = cfg.chat_template or packaged_template(target.chat_template)  # GLM presets: glm.jinja
    encoder = load_encoder(str(mdir), chat_template_file=template_file, system_prompt=cfg.system_prompt,
                           special_text=cfg.special_text, template_kwargs=cfg.chat_template_kwargs)
    model_cfg = json.loads((mdir / "config.json").read_text())
    vllm_args = vllm_engine_args(cfg.tp, cfg.max_model_len, cfg.gpu_memory_utilization, cfg.vllm_args)
    engine = engine_spec(cfg.engine, cfg.vllm_path, vllm_args, model_cfg)
    if engine.name != "vllm":  # refused, not silently ignored
        vllm_only = [flag for flag, given in (("--vllm-path", cfg.vllm_path != "auto"), ("--tp", cfg.tp != 1),
                                              ("--max-model-len", cfg.max_model_len is not None),
                                              ("--gpu-memory-utilization", cfg.gpu_memory_utilization is not None),
                                              ("--vllm-arg", bool(cfg.vllm_args))) if given]
        if vllm_only:
            why = " (--engine auto picks vllm only when vLLM is installed and a GPU is visible)" if cfg.engine == "auto" else ""
            raise CaptureError(f"{vllm_only[0]} applies only to the vllm engine; this run uses {engine.name}{why}")
    if engine.name == "exl3" and cfg.responses == "regenerate":
        raise CaptureError("--engine exl3 captures prefills only; --responses regenerate needs the hf or vllm engine")
    header = shard_format.header(
        target={"name": target.name, "source": target.source, "revision": target.revision,
                "architecture": target.architecture, "num_layers": target.num_layers},
        taps=taps.describe(),
        columns=list(taps.columns),
        hidden_size=target.hidden_size,
        dtype="float16" if engine.name == "exl3" else target.dtype,  # exllamav3 exports fp16 states
        codec=cfg.codec,
        argmax=cfg.argmax,
        chat_template=encoder.template,
        chat_template_sha256=encoder.template_sha256,
        tokenizer_sha256=tokenizer_sha256(encoder.tokenizer),
        responses=responses_header(cfg, encoder.end_ids),
    )
    header["engine"] = engine.describe()
    header["engine_version"] = engine.version()
    context = model_cfg.get("max_position_embeddings")
    limit = vllm_args.get("max_model_len") if engine.name == "vllm" else None
    if limit:  # vLLM rejects prompts beyond its max_model_len (--max-model-len or --vllm-arg max_model_len=)
        context = min(context or limit, limit)
    return Prepared(target, taps, str(mdir), encoder, header, context, dataset, engine)


def _records(cfg: RunConfig, prep: Prepared, summary: Summary, done: set[str], seen: set[str]):
    """Stream kept records in dataset order; every other row is counted in ``summary.skipped``.
    Regenerate mode yields :class:`capture.chat.Prompt` records, filtered by :func:`filters.filter_prompt`."""
    stats = ReadStats()
    skipped: collections.Counter = collections.Counter()
    specials = prep.encoder.special_strings()
    convs = iter_conversations(prep.dataset, stats, limit=cfg.limit, sources=cfg.sources,
                               exclude_sources=cfg.exclude_sources, source_caps=dict(cfg.source_caps) or None,
                               alternation=cfg.alternation)
    try:
        for conv in convs:
            if conv.sample_id in done:
                summary.already_committed += 1
                continue
            if cfg.responses == "regenerate":
                rec = prep.encoder.encode_prompt(conv, cfg.regenerate_policy, specials)
            else:
                rec = prep.encoder.encode(conv, specials)
            if isinstance(rec, str):
                skipped[rec] += 1
                continue
            if cfg.responses == "regenerate":
                reason = filter_prompt(rec, cfg.filters, seen, prep.context_len, cfg.max_new_tokens)
            else:
                rec, reason = apply_filters(rec, cfg.filters, seen, prep.context_len)
            if reason:
                skipped[reason] += 1
                log.debug("%s dropped: %s", conv.sample_id, reason)
                continue
            summary.kept += 1
            summary.rows_read = stats.rows_read  # live, for the progress bar's ETA
            yield rec
    finally:
        summary.rows_read = stats.rows_read
        summary.skipped = dict(stats.skipped + skipped)
        summary.normalized = dict(stats.normalized)
        summary.truncated_input = stats.truncated


def _units(records, unit_tokens: int):
    unit: list[Tokenized] = []
    size = 0
    for rec in records:
        unit.append(rec)
        size += rec.num_tokens
        if size >= unit_tokens:
            yield unit
            unit, size = [], 0
    if unit:
        yield unit


def bytes_per_token(header: dict, codec: str | None = None) -> float:
    """Estimated stored bytes per token: states at the codec's measured ratio, plus ids, mask, argmax."""
    states = len(header["columns"]) * header["hidden_size"] * 2 * codecs.RATIO[codec or header["codec"]]
    return states + 4 + 1 + (4 if header["argmax"] else 0)


def plan(cfg: RunConfig) -> Summary:
    """``--dry-run``: read, tokenize and filter exactly as the run would; estimate tokens and bytes
    (regenerate mode: the prompt tokens plus the whole generation budget, an upper bound)."""
    prep = prepare(cfg)
    loc = resolve(cfg.out)
    m = manifest_mod.read(loc)
    if m.header is not None and (diff := manifest_mod.identity_diff(m.header, prep.header)):
        raise CaptureError(f"{cfg.out} holds a run with a different {', '.join(diff)}; use another --out")
    manifest_mod.check_dataset(m, dataclasses.asdict(prep.dataset))
    summary = Summary(out=cfg.out)
    seen = m.token_hashes() if cfg.filters.dedup else set()
    budget = cfg.max_new_tokens if cfg.responses == "regenerate" else 0
    records = _records(cfg, prep, summary, m.sample_ids(), seen)
    tokens = sum(r.num_tokens + budget * getattr(r, "turns", 0) for r in records)
    summary.estimated_tokens = tokens
    summary.estimated_bytes = int(tokens * bytes_per_token(prep.header))
    summary.estimated_bytes_by_codec = {c: int(tokens * bytes_per_token(prep.header, c)) for c in codecs.CODECS}
    if loc.local:  # an object store has no free space to speak of
        existing = next(p for p in (Path(loc.path).resolve(), *Path(loc.path).resolve().parents) if p.exists())
        summary.free_bytes = _free_bytes(str(existing))
    summary.total_rows = sum(s["rows"] for s in m.shards)
    return summary


def _free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def run(cfg: RunConfig) -> Summary:
    """Run (or resume, or extend) the capture described by ``cfg``. Returns the :class:`Summary`.

    Raises CaptureError on user errors, on a conflicting existing run, when the disk fills (after a
    clean stop), and when no record at all could be kept.
    """
    if cfg.dry_run:
        return plan(cfg)

    from filelock import FileLock, Timeout

    started = time.time()
    prep = prepare(cfg)
    loc = resolve(cfg.out)
    if not loc.local:
        return _run_object_store(cfg, prep, started, loc)
    cfg = dataclasses.replace(cfg, out=loc.path)  # a file:// URI: its path from here on
    out = Path(cfg.out)
    if out.is_dir() and not (out / manifest_mod.MANIFEST).exists() and any(p.name != manifest_mod.LOCK for p in out.iterdir()):
        raise CaptureError(f"{cfg.out} is not empty and holds no capture run ({manifest_mod.MANIFEST}); "
                           "give a new or empty folder")
    if out.exists() and not out.is_dir():
        raise CaptureError(f"--out {cfg.out} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = FileLock(out / manifest_mod.LOCK)
        lock.acquire(timeout=0)
    except Timeout:
        raise CaptureError(f"another capture is writing to {cfg.out} (it holds {manifest_mod.LOCK}); wait for it or use another --out") from None
    except OSError as e:
        raise CaptureError(f"cannot write to --out {cfg.out}: {e.strerror}") from None
    try:
        return _run_locked(cfg, prep, started, loc)
    finally:
        lock.release()


def _run_object_store(cfg: RunConfig, prep: Prepared, started: float, loc: Location) -> Summary:
    """:func:`run` on an object store: the run is marked by its advisory lock object for its duration."""
    if manifest_mod.read(loc).header is None and (loc.names() or loc.names(manifest_mod.MANIFEST_DIR)):
        raise CaptureError(f"{cfg.out} is not empty and holds no capture run ({manifest_mod.MANIFEST_DIR}/); "
                           "give a new or empty prefix")
    try:
        manifest_mod.lock_object(loc)
    except OSError as e:
        raise CaptureError(f"cannot write to --out {cfg.out}: {e}") from None
    try:
        return _run_locked(cfg, prep, started, loc)
    finally:
        try:
            loc.delete(manifest_mod.LOCK)
        except OSError as e:  # the store fails: the run's own outcome is what to report
            log.warning("cannot remove %s: %s; delete it before the next run", loc.join(manifest_mod.LOCK), e)


def _run_locked(cfg: RunConfig, prep: Prepared, started: float, loc: Location) -> Summary:
    import ray

    we_started_ray = not ray.is_initialized()
    if we_started_ray:
        # "local": a new instance even where `ray start` left a (maybe stale) /tmp/ray/ray_current_cluster
        ray.init(address=cfg.ray_address or "local", num_cpus=None if cfg.ray_address else os.cpu_count(),
                 include_dashboard=False, logging_level=logging.ERROR, log_to_driver=True)
    try:
        return _run_on_ray(cfg, prep, started, loc)
    finally:
        if we_started_ray:
            ray.shutdown()


def _run_on_ray(cfg: RunConfig, prep: Prepared, started: float, loc: Location) -> Summary:
    import ray

    total_cpus = int(ray.cluster_resources().get("CPU", 0))
    cpus = cfg.cpus_per_replica or max(1, total_cpus // cfg.replicas)
    if cpus * cfg.replicas > total_cpus:  # before anything is written
        raise CaptureError(f"{cfg.replicas} replica(s) x {cpus} CPU(s) do not fit the {total_cpus} CPU(s) Ray has; "
                           "lower --replicas or --cpus-per-replica")
    try:
        writer, manifest = manifest_mod.ManifestWriter.open(loc, prep.header)
        writer.dataset(manifest, dataclasses.asdict(prep.dataset))
    except OSError as e:
        raise CaptureError(f"cannot write the manifest in {cfg.out}: {e.strerror or e}") from None
    garbage = manifest_mod.garbage(loc, manifest)
    if garbage:
        log.warning("%s: %d uncommitted file(s) from an interrupted run are ignored (removed when this run completes)",
                    cfg.out, len(garbage))
    if loc.local and _free_bytes(cfg.out) < cfg.disk_reserve:
        raise CaptureError(f"only {_free_bytes(cfg.out) / 2**20:.0f} MiB free at {cfg.out}; free some space first")
    try:
        record = provenance.start(loc, header=prep.header, model_dir=prep.model_dir,
                                  dataset=dataclasses.asdict(prep.dataset), filters=_filter_settings(cfg),
                                  started=started)
    except OSError as e:
        raise CaptureError(f"cannot write {provenance.PROVENANCE} in {cfg.out}: {e.strerror or e}") from None
    summary = Summary(out=cfg.out)
    seen = manifest.token_hashes() if cfg.filters.dedup else set()
    per_token = bytes_per_token(prep.header)

    # a vLLM replica on a GPU cluster holds its TP group's GPUs (Ray sets CUDA_VISIBLE_DEVICES for it)
    gpus = cfg.tp if prep.engine.name == "vllm" and ray.cluster_resources().get("GPU", 0) else 0
    actor_cls = ray.remote(num_cpus=cpus, num_gpus=gpus)(_replica_class())

    out = str(Path(cfg.out).resolve()) if loc.local else cfg.out  # a replica resolves the URI itself

    def make_actor():
        return actor_cls.remote(prep.model_dir, prep.taps, prep.header, out,
                                shard_size=cfg.shard_size, batch_tokens=cfg.batch_tokens, threads=cpus,
                                codec_threads=cfg.codec_threads, engine=prep.engine, filters=cfg.filters)

    bar = _progress(cfg)
    rejected: collections.Counter = collections.Counter()
    prefilled = [0]  # rows through the engine (committed once their shard closes)

    def commit(infos) -> None:
        for info in infos:
            writer.commit(info)
            summary.shards += 1
            summary.committed_rows += info.rows
            summary.committed_tokens += info.tokens
            summary.committed_loss_tokens += info.loss_tokens
            summary.committed_bytes += info.bytes

    def on_result(result) -> None:
        rejected.update(result.rejected.values())
        prefilled[0] += result.rows
        bar.update(result.tokens)
        eta = _eta(time.time() - started, summary.rows_read, cfg.limit)
        bar.set_postfix(rows=prefilled[0], committed=summary.committed_rows,
                        MiB=round(summary.committed_bytes / 2**20), **({"eta": eta} if eta else {}), refresh=False)

    stop: str | None = None
    pool = None
    try:
        pool = ReplicaPool(make_actor, cfg.replicas, commit=commit, on_result=on_result,
                           unit_timeout=cfg.unit_timeout, max_attempts=cfg.max_unit_attempts)
        for unit in _units(_records(cfg, prep, summary, manifest.sample_ids(), seen), cfg.unit_tokens):
            need = sum(r.num_tokens for r in unit) * per_token * (cfg.replicas + 1) + cfg.disk_reserve
            if loc.local and _free_bytes(cfg.out) < need:
                stop = f"only {_free_bytes(cfg.out) / 2**20:.0f} MiB free at {cfg.out}, the next unit needs ~{need / 2**20:.0f} MiB"
                break
            pool.submit(unit)
        pool.finish()
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        stop = f"the disk at {cfg.out} is full ({e})"
    finally:
        bar.close()
        if pool is not None:
            summary.replicas = [dataclasses.asdict(s) for s in pool.stats]
            summary.quarantined = dict(pool.quarantined)
    summary.rejected = dict(rejected)
    manifest_now = manifest_mod.read(loc)
    summary.total_rows = sum(s["rows"] for s in manifest_now.shards)
    summary.total_tokens = sum(s["tokens"] for s in manifest_now.shards)
    summary.seconds = round(time.time() - started, 2)
    ended = time.time()
    if stop:
        _finish_provenance(loc, record, summary, "stopped", ended)
        raise CaptureError(
            f"stopped cleanly: {stop}; {summary.shards} shard(s) committed in this run, nothing half-written. "
            "Free some space and rerun the same command to resume"
        )
    _remove_garbage(loc)
    writer.complete({
        "end_time": provenance.record.utc_now(ended),
        "dataset": dataclasses.asdict(prep.dataset),
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
    })
    _finish_provenance(loc, record, summary, "complete", ended)
    if summary.total_rows == 0:
        reasons = {**summary.skipped, **summary.rejected}
        detail = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])) or "no rows read"
        raise CaptureError(f"no records written: all {summary.rows_read} rows read were dropped ({detail})")
    return summary


def _eta(elapsed: float, rows_read: int, limit: int | None) -> str | None:
    """Time left as H:MM:SS when the rows to read are known (``--limit``), from the rows read so far
    (they run at most two units per replica ahead of the engine); None otherwise."""
    if not limit or not rows_read:
        return None
    left = max(0.0, elapsed * (limit - rows_read) / rows_read)
    return time.strftime("%H:%M:%S", time.gmtime(left))


def _remove_garbage(loc: Location) -> None:
    """Remove every uncommitted shard file at the end of a run: what failed replicas and killed runs left.
    Only the driver commits, so no file the manifest does not name can ever become part of the run; every
    live replica has finished and the run lock is held."""
    removed = manifest_mod.garbage(loc)
    manifest_mod.remove(loc, removed)
    if removed:
        log.info("removed %d uncommitted shard file(s) left by failed replicas or interrupted runs", len(removed))


def _finish_provenance(loc: Location, record: dict, summary: Summary, status: str, ended: float) -> None:
    try:
        provenance.finish(loc, record, status=status, rows_read=summary.rows_read,
                          rows_committed=summary.committed_rows, shards_committed=summary.shards, ended=ended)
    except OSError as e:  # a full disk: the shards and the manifest are what counts
        log.warning("cannot update %s in %s: %s", provenance.PROVENANCE, loc.path, e.strerror or e)


def _filter_settings(cfg: RunConfig) -> dict:
    """Every setting that decides which dataset rows become records (for provenance.json)."""
    return {**dataclasses.asdict(cfg.filters), "limit": cfg.limit, "sources": list(cfg.sources),
            "exclude_sources": list(cfg.exclude_sources), "source_caps": dict(cfg.source_caps),
            "alternation": cfg.alternation, "special_text": cfg.special_text, "system_prompt": cfg.system_prompt}


def _replica_class():
    from capture.replica import Replica

    return Replica


def _progress(cfg: RunConfig):
    from tqdm import tqdm

    return tqdm(desc="capture", unit="tok", unit_scale=True, disable=not cfg.progress, dynamic_ncols=True)
