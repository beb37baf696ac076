"""The driver: dataset rows → conversations → tokens + loss mask → filters → work units → replicas.

Replicas are Ray actors (a local ``ray.init()`` unless ``ray_address`` is given), or, for one HF replica
on this machine, an object in the driver's own process (:func:`executor_of`); the driver streams the
dataset (never holding it), tokenizes and filters in order, hands work units of ~``unit_tokens`` tokens
to a :class:`capture.pool.ReplicaPool` (two units queued per replica; a replica that dies or hangs is
replaced and its uncommitted records handed out again), and commits every shard a replica
closes with one manifest line. Rerunning the same command resumes: sample ids already in the manifest
are skipped before tokenization, and the dedup filter is seeded with the committed token hashes.

A run stops cleanly (everything committed stays committed, no completion record) when the disk is about
to fill or fills; a run that keeps no record at all raises CaptureError with the counts by reason.

``--out`` may name a run on any file system pyarrow supports (:mod:`shards.run`). On an object store
there is no rename and no append: shards are written under their final names, the manifest is one
object per entry, the run lock is an advisory ``.capture.lock`` object, and free space is not checked
(:class:`shards.run.Location` owns these differences). Engine rules come from the engine's declared
:class:`capture.engines.base.Capabilities`, never from its name.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import logging
import os
import time
from typing import Callable

import pyarrow.fs as pafs

from capture.chat import ChatEncoder, load_encoder, packaged_template, tokenizer_sha256
from common.records import Tokenized
from capture.config import RunConfig
from capture.engines import NAMES, EngineSpec, engine_class, engine_spec, resolve_engine, vllm_engine_args
from capture.data import DatasetRef, ReadStats, iter_conversations, resolve_dataset
from common.errors import CaptureError
from capture.pool import LocalActor, LocalCalls, RayCalls, ReplicaPool
from capture.regenerate import responses_header
from capture.progress import LocalFeed, Progress, Timings, feed
from capture.targets import Taps, Target, make_taps, model_dir, resolve_target
from filters import apply_filters, filter_prompt
import provenance
from shards import codecs
from shards import online
from shards import topk as topk_mod
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards.format import RunHeader
from shards.retain import Retention
from shards.run import LOCK, Location, resolve

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
    shards: int = 0  # shards committed (an online run without keep commits none)
    delivered_units: int = 0  # online: units whose payload went to the trainer side (rows all acked: not queued)
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
    timings: dict = dataclasses.field(default_factory=dict)  # seconds: capture.progress.Timings
    quarantined: dict = dataclasses.field(default_factory=dict)  # sample_id → reason (failed every attempt)
    executor: str = ""  # where the replicas ran: "ray" (actors) or "local" (the driver's process)
    self_check: dict | None = None  # --self-check: provenance.check's verdict on rows of this run (None: not run)
    engine: str = ""  # the engine that ran (or would run) and why: Prepared.engine_choice
    # --retain N: limit, removed_shards, removed_rows (by this invocation), peak_live (most committed shards
    # on disk), wait_seconds (waiting for reader acks); None without --retain
    retained: dict | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Prepared:
    target: Target
    taps: Taps
    model_dir: str
    encoder: ChatEncoder
    header: RunHeader
    context_len: int | None
    dataset: DatasetRef
    engine: EngineSpec
    engine_choice: str = ""  # which engine (and vLLM path) runs, and why: "vllm, extract path (auto: ...)"


def _flag(option: str) -> str:
    """The command-line flag of an engine option (``compute_dtype`` → ``--dtype``)."""
    return {"vllm_args": "--vllm-arg", "compute_dtype": "--dtype"}.get(option, "--" + option.replace("_", "-"))


def prepare(cfg: RunConfig) -> Prepared:
    """Resolve target, taps, dataset, model folder, tokenizer and run header (no engine loaded): every
    user error is raised here, before anything is written."""
    given = {"compute_dtype": cfg.compute_dtype != "auto", "device": cfg.device != "auto",
             "gpus_per_replica": cfg.gpus_per_replica is not None,
             "vllm_path": cfg.vllm_path != "auto", "tp": cfg.tp != 1, "max_model_len": cfg.max_model_len is not None,
             "gpu_memory_utilization": cfg.gpu_memory_utilization is not None, "vllm_args": bool(cfg.vllm_args)}
    taken = {n: tuple(_flag(o) for o in engine_class(n).capabilities.options if given[o]) for n in ("hf", "vllm")}
    name, why = resolve_engine(cfg.engine, taken["hf"], taken["vllm"])
    ran = run_engine(cfg.out) if cfg.engine == "auto" else None
    if ran and ran != name:  # the states of one run come from one engine
        name, why = ran, f"the run in {cfg.out} was started with it; a resume keeps its engine"
    if cfg.topk and not engine_class(name).capabilities.topk:  # an engine that cannot give top-K, wherever it runs
        takers = " or ".join(n for n in NAMES[1:] if engine_class(n).capabilities.topk)
        raise CaptureError(f"--topk {cfg.topk}: the {name} engine cannot give top-K log-probabilities; use the {takers} engine")
    if name == "exl3":  # then one that cannot run here, before any loading
        from capture.engines.exl3 import check_exl3

        check_exl3()
    target = resolve_target(cfg.target)
    taps = make_taps(target, cfg.layers, cfg.final)
    dataset = resolve_dataset(cfg.dataset, cfg.split)
    mdir = model_dir(target, cfg.model_path)
    template_file = cfg.chat_template or packaged_template(target.chat_template)  # GLM presets: glm.jinja
    encoder = load_encoder(str(mdir), chat_template_file=template_file, system_prompt=cfg.system_prompt,
                           special_text=cfg.special_text, template_kwargs=cfg.chat_template_kwargs)
    model_cfg = json.loads((mdir / "config.json").read_text())
    if cfg.topk:
        vocab = model_cfg.get("text_config", model_cfg).get("vocab_size") or model_cfg.get("vocab_size")
        if vocab and cfg.topk > int(vocab):
            raise CaptureError(f"--topk {cfg.topk} is more than the target's vocabulary ({vocab} tokens)")
    vllm_args = vllm_engine_args(cfg.tp, cfg.max_model_len, cfg.gpu_memory_utilization, cfg.vllm_args)
    caps = engine_class(name).capabilities
    foreign = [name for name, set_ in given.items() if set_ and name not in caps.options]
    if foreign:  # refused, not silently ignored
        takers = [n for n in NAMES[1:] if foreign[0] in engine_class(n).capabilities.options]
        why = f" (--engine auto: {why})" if cfg.engine == "auto" else ""
        raise CaptureError(f"{_flag(foreign[0])} applies only to the {' and '.join(takers)} engine; this run uses {name}{why}")
    engine = engine_spec(name, cfg.vllm_path, vllm_args, model_cfg, cfg.compute_dtype,
                         caps.state_dtype or target.dtype, cfg.device, cfg.gpus_per_replica, taps.final != "none")
    if cfg.responses == "regenerate" and not caps.generates:
        makers = " or ".join(n for n in NAMES[1:] if engine_class(n).capabilities.generates)
        raise CaptureError(f"--engine {engine.name} captures prefills only; --responses regenerate needs the {makers} engine")
    header = shard_format.header(
        target={"name": target.name, "source": target.source, "revision": target.revision,
                "architecture": target.architecture, "num_layers": target.num_layers},
        taps=taps.describe(),
        columns=list(taps.columns),
        hidden_size=target.hidden_size,
        dtype=caps.state_dtype or target.dtype,  # e.g. exllamav3 exports fp16 states
        codec=cfg.codec,
        argmax=cfg.argmax,
        chat_template=encoder.template,
        chat_template_sha256=encoder.template_sha256,
        tokenizer_sha256=tokenizer_sha256(encoder.tokenizer),
        responses=responses_header(cfg, encoder.end_ids),
        engine=engine.describe(),
        engine_version=engine.version(),
        topk=cfg.topk,
    )
    context = model_cfg.get("max_position_embeddings")
    limit = engine.context_limit
    if limit:  # vLLM rejects prompts beyond its max_model_len (--max-model-len or --vllm-arg max_model_len=)
        context = min(context or limit, limit)
    return Prepared(target, taps, str(mdir), encoder, header, context, dataset, engine,
                    f"{name}" + (f", {engine.vllm_path} path" if name == "vllm" else "")
                    + f" ({'auto: ' if cfg.engine == 'auto' else ''}{why})")


def run_engine(out: str) -> str | None:
    """The engine the run at ``out`` was captured with (its header's ``engine.name``), None when there is
    no run there, it holds nothing yet (:func:`shards.manifest.holds_nothing`), or it cannot be read
    (``run`` reports that itself)."""
    try:
        m = manifest_mod.read(resolve(out))
    except Exception:  # noqa: BLE001 - a missing or unreadable folder: run() gives the message
        return None
    if m.header is None or manifest_mod.holds_nothing(resolve(out), m):  # nothing committed: choose afresh
        return None
    return m.header.engine.get("name")


def resume_arithmetic(cfg: RunConfig, prep: Prepared, existing: manifest_mod.Manifest) -> Prepared:
    """``--dtype auto`` on a resume: the hf engine computes in the dtype the run started with (its header's
    ``engine.compute_dtype``; absent: the state dtype), whatever this machine's ``auto`` would pick, so the
    states of one run come from one arithmetic. A ``--dtype`` given explicitly must be the run's: another
    raises CaptureError naming both."""
    if existing.header is None or prep.engine.name != "hf" or existing.header.engine.get("name") != "hf":
        return prep
    ran = existing.header.engine.get("compute_dtype")
    if ran == prep.engine.compute_dtype:
        return prep
    if cfg.compute_dtype != "auto":
        raise CaptureError(f"{cfg.out} was computed in {ran or existing.header.dtype}; --dtype {cfg.compute_dtype} "
                           "would mix two arithmetics in one run: leave --dtype out (a resume keeps the run's) "
                           "or use another --out")
    log.info("resuming in the run's own compute dtype %s (--dtype auto would pick %s on this machine)",
             ran or prep.header.dtype, prep.engine.compute_dtype or prep.header.dtype)
    engine = dataclasses.replace(prep.engine, compute_dtype=ran)
    return dataclasses.replace(prep, engine=engine, header=prep.header.replace(engine=engine.describe()))


def _records(cfg: RunConfig, prep: Prepared, summary: Summary, done: set[str], seen: set[str]):
    """Stream kept records in dataset order; every other row is counted in ``summary.skipped``.
    Regenerate mode yields :class:`capture.chat.Prompt` records, filtered by :func:`filters.filter_prompt`."""
    stats = ReadStats()
    skipped: collections.Counter = collections.Counter()
    specials = prep.encoder.special_strings()
    convs = iter_conversations(prep.dataset, stats, limit=cfg.limit, skip=cfg.skip, sources=cfg.sources,
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


def _units(records, unit_tokens: int, first: int = 0, first_tokens: int = 0):
    """Work units of about ``unit_tokens`` tokens (a unit ends with the record that reaches the size); the
    first ``first`` units hold about ``first_tokens`` (one per replica: each replica's first shard commits
    early)."""
    unit: list[Tokenized] = []
    size = 0
    sent = 0
    for rec in records:
        unit.append(rec)
        size += rec.num_tokens
        if size >= (min(first_tokens, unit_tokens) if sent < first else unit_tokens):
            yield unit
            unit, size, sent = [], 0, sent + 1
    if unit:
        yield unit


def bytes_per_token(header: RunHeader, codec: str | None = None) -> float:
    """Estimated stored bytes per token: states at the codec's measured ratio, plus ids, mask, argmax and
    the top-K cells (measured bytes per kept entry, :data:`shards.topk.BYTES_PER_ENTRY`)."""
    states = header.raw_bytes_per_token * codecs.RATIO[codec or header.codec]
    return states + 4 + 1 + (4 if header.argmax else 0) + header.topk * topk_mod.BYTES_PER_ENTRY


def plan(cfg: RunConfig) -> Summary:
    """``--dry-run``: read, tokenize and filter exactly as the run would; estimate tokens and bytes
    (regenerate mode: the prompt tokens plus the whole generation budget, an upper bound)."""
    prep = prepare(cfg)
    loc = resolve(cfg.out)
    if loc.kind() == pafs.FileType.File:
        raise CaptureError(f"--out {cfg.out} exists and is not a folder")
    m = manifest_mod.read(loc)
    if m.header is None and [e for e in loc.entries() if e != LOCK]:
        raise CaptureError(f"{cfg.out} is not empty and holds no capture run ({loc.manifest_name}); "
                           "give a new or empty folder")
    prep = resume_arithmetic(cfg, prep, m)
    manifest_mod.check_identity(cfg.out, m, prep.header)  # the message the real run gives (old → new values)
    manifest_mod.check_dataset(m, dataclasses.asdict(prep.dataset))
    summary = Summary(out=cfg.out, engine=prep.engine_choice)
    seen = m.token_hashes() if cfg.filters.dedup else set()
    budget = cfg.max_new_tokens if cfg.responses == "regenerate" else 0
    records = _records(cfg, prep, summary, m.sample_ids(), seen)
    tokens = sum(r.num_tokens + budget * getattr(r, "turns", 0) for r in records)
    summary.estimated_tokens = tokens
    summary.estimated_bytes = int(tokens * bytes_per_token(prep.header))
    summary.estimated_bytes_by_codec = {c: int(tokens * bytes_per_token(prep.header, c)) for c in codecs.CODECS}
    summary.free_bytes = loc.free_bytes()  # None on an object store
    summary.total_rows = m.rows
    return summary


def run(cfg: RunConfig, deliver: Callable | None = None, keep: bool = False) -> Summary:
    """Run (or resume, or extend) the capture described by ``cfg``. Returns the :class:`Summary`.

    ``deliver``: an online run (:mod:`capture.online`): replicas run on Ray in stream mode and each
    unit's rows go to ``deliver(info, payload, on_wait)`` (``info`` a ShardInfo with path "", ``payload``
    the handle of the unit's Arrow IPC bytes, :class:`shards.writer.StreamWriter`; ``on_wait(status)`` to
    call while it blocks); without ``keep`` no shard is written and rows acked in ``cfg.out``
    (:func:`shards.online.consumed_ids`) count as done; with ``keep`` the rows are also committed to
    shards exactly as without ``deliver``.

    Raises CaptureError on user errors, on a conflicting existing run, when the disk fills (after a
    clean stop), and when no record at all could be kept.
    """
    if cfg.dry_run:
        return plan(cfg)

    started = time.time()
    progress = Progress(cfg.progress)
    timings = Timings()
    try:
        progress.status("preparing: model, tokenizer, dataset")
        prep = prepare(cfg)
        timings.prepare = time.time() - started
        loc = resolve(cfg.out)
        if loc.kind() == pafs.FileType.File:
            raise CaptureError(f"--out {cfg.out} exists and is not a folder")
        existing = manifest_mod.read(loc)
        if existing.header is None and [e for e in loc.entries() if e != LOCK]:
            raise CaptureError(f"{cfg.out} is not empty and holds no capture run ({loc.manifest_name}); "
                               "give a new or empty folder")
        if not manifest_mod.holds_nothing(loc, existing):  # a run with nothing committed may start again
            prep = resume_arithmetic(cfg, prep, existing)
            manifest_mod.check_identity(cfg.out, existing, prep.header)  # before Ray starts (again under the lock)
        damaged = [e["path"] for e in existing.shards if loc.size(e["path"]) != e["bytes"]]
        if damaged:  # a resume would skip their rows for good
            raise CaptureError(f"{cfg.out}: {len(damaged)} committed shard(s) are missing or of another size "
                               f"({damaged[0]}); `capture shards verify {cfg.out}` lists them: restore them first")
        busy = f"another capture is writing to {cfg.out} (it holds {LOCK}); wait for it or use another --out"
        with loc.lock(busy=busy):
            return _run_locked(cfg, prep, started, loc, progress, timings, deliver, keep)
    finally:
        progress.close()


def replica_gpus(engine: EngineSpec, tp: int, cluster_gpus: float) -> int:
    """GPUs a Ray replica reserves (Ray sets its CUDA_VISIBLE_DEVICES): a cuda hf replica its ``engine.gpus``
    (CaptureError when the cluster has fewer), a vLLM replica its TP group's ``tp`` on a GPU cluster (none
    on a CPU one: vLLM-CPU), others none."""
    if engine.device == "cuda":
        if cluster_gpus < engine.gpus:
            raise CaptureError(f"--device cuda: the Ray cluster has {cluster_gpus:g} GPU(s), a replica needs {engine.gpus}")
        return engine.gpus
    return tp if engine.capabilities.gpus_per_tp_rank and cluster_gpus else 0


def executor_of(cfg: RunConfig, engine: EngineSpec) -> str:
    """``cfg.executor``, with ``auto`` resolved: ``local`` (the replica in the driver's process: no Ray
    daemons, one process; bench/peer_modelopt.out) for one HF replica with no Ray address and no unit
    timeout, else ``ray``. vLLM and EXL3 replicas always run as Ray actors under ``auto`` (a replica that
    owns GPUs or its own engine processes is worth isolating)."""
    if cfg.executor != "auto":
        return cfg.executor
    alone = cfg.replicas == 1 and cfg.ray_address is None and cfg.unit_timeout is None
    return "local" if alone and engine.name == "hf" else "ray"


def _run_locked(cfg: RunConfig, prep: Prepared, started: float, loc: Location, progress: Progress,
                timings: Timings, deliver: Callable | None = None, keep: bool = False) -> Summary:
    if deliver is not None and cfg.executor == "local":
        raise CaptureError("an online run streams rows through Ray: it needs --executor ray or auto")
    if deliver is None and executor_of(cfg, prep.engine) == "local":
        progress.feed = LocalFeed()
        try:
            return _run_replicas(cfg, prep, started, loc, progress, timings, "local")
        finally:
            progress.close()
    import ray

    we_started_ray = not ray.is_initialized()
    if we_started_ray:
        progress.status("starting Ray")
        # "local": a new instance even where `ray start` left a (maybe stale) /tmp/ray/ray_current_cluster
        ray.init(address=cfg.ray_address or "local", num_cpus=None if cfg.ray_address else os.cpu_count(),
                 include_dashboard=False, logging_level=logging.ERROR, log_to_driver=True)
    try:
        progress.feed = feed()
        return _run_replicas(cfg, prep, started, loc, progress, timings, "ray", deliver, keep)
    finally:
        progress.close()  # the feed's actor goes before Ray does
        if we_started_ray:
            ray.shutdown()


def _run_replicas(cfg: RunConfig, prep: Prepared, started: float, loc: Location, progress: Progress,
                  timings: Timings, executor: str, deliver: Callable | None = None, keep: bool = False) -> Summary:
    stream = None if deliver is None else "tee" if keep else "deliver"
    if executor == "ray":
        import ray

        total_cpus, where = int(ray.cluster_resources().get("CPU", 0)), "Ray has"
    else:
        total_cpus, where = len(os.sched_getaffinity(0)), "this process may use"
    cpus = cfg.cpus_per_replica or max(1, total_cpus // cfg.replicas)
    if cpus * cfg.replicas > total_cpus:  # before anything is written
        raise CaptureError(f"{cfg.replicas} replica(s) x {cpus} CPU(s) do not fit the {total_cpus} CPU(s) {where}; "
                           "lower --replicas or --cpus-per-replica")
    try:
        writer, manifest = manifest_mod.ManifestWriter.open(loc, prep.header)
        writer.dataset(manifest, dataclasses.asdict(prep.dataset))
    except OSError as e:
        raise CaptureError(f"cannot write the manifest in {cfg.out}: {e.strerror or e}") from None
    if manifest.header is not None:  # a resumed run keeps the cell layout of the version that started it
        prep = dataclasses.replace(prep, header=prep.header.replace(format_version=manifest.header.format_version))
    garbage = manifest_mod.garbage(loc, manifest)
    if garbage:
        log.warning("%s: %d uncommitted file(s) from an interrupted run are ignored (removed when this run completes)",
                    cfg.out, len(garbage))
    free = loc.free_bytes()  # None on an object store
    if free is not None and free < cfg.disk_reserve:
        raise CaptureError(f"only {free / 2**20:.0f} MiB free at {cfg.out}; free some space first")
    try:
        record = provenance.start(loc, header=prep.header, model_dir=prep.model_dir,
                                  dataset=dataclasses.asdict(prep.dataset), filters=_filter_settings(cfg),
                                  started=started)
    except OSError as e:
        raise CaptureError(f"cannot write {provenance.PROVENANCE} in {cfg.out}: {e.strerror or e}") from None
    summary = Summary(out=cfg.out, executor=executor, engine=prep.engine_choice)
    seen = manifest.token_hashes() if cfg.filters.dedup else set()
    per_token = bytes_per_token(prep.header)

    from capture.replica import Replica

    out = loc.absolute()  # a Ray replica is another process, maybe in another folder
    args = (prep.model_dir, prep.taps, prep.header, out)
    kwargs = dict(shard_size=cfg.shard_size, batch_tokens=cfg.batch_tokens, threads=cpus,
                  commit_seconds=cfg.commit_every, codec_threads=cfg.codec_threads, engine=prep.engine,
                  filters=cfg.filters, feed=progress.feed, stream=stream)
    if executor == "ray":
        gpus = replica_gpus(prep.engine, cfg.tp, ray.cluster_resources().get("GPU", 0))
        actor_cls = ray.remote(num_cpus=cpus, num_gpus=gpus)(Replica)
        calls = RayCalls()

        def make_actor():
            return actor_cls.remote(*args, **kwargs)
    else:
        calls = LocalCalls()

        def make_actor():
            return LocalActor(Replica(*args, **kwargs))

    rejected: collections.Counter = collections.Counter()
    prefilled = [0]  # rows through the engine (committed once their shard closes)

    retention = None if cfg.retain is None else Retention(loc, writer, cfg.retain, on_wait=progress.tick)

    def commit(infos) -> None:
        t0, waited = time.perf_counter(), retention.wait_seconds if retention else 0.0
        for info in infos:
            if retention is not None and retention.make_room():
                progress.status("capturing")
            writer.commit(info)
            summary.shards += 1
            summary.committed_rows += info.rows
            summary.committed_tokens += info.tokens
            summary.committed_loss_tokens += info.loss_tokens
            summary.committed_bytes += info.bytes
        timings.commit += time.perf_counter() - t0 - ((retention.wait_seconds - waited) if retention else 0.0)

    def hand_over(info, payload) -> None:  # online: a unit's rows to the trainer
        deliver(info, payload, progress.tick)
        progress.status("capturing")
        summary.delivered_units += 1
        if stream == "deliver":  # no shards: what was delivered is what this run committed
            summary.committed_rows += info.rows
            summary.committed_tokens += info.tokens
            summary.committed_loss_tokens += info.loss_tokens

    def on_result(result) -> None:
        rejected.update(result.rejected.values())
        prefilled[0] += result.rows
        eta = _eta(time.time() - started, prefilled[0] + sum(rejected.values()), summary.kept, summary.rows_read,
                   cfg.limit)
        progress.postfix(rows=prefilled[0], committed=summary.committed_rows,
                         MiB=round(summary.committed_bytes / 2**20), **({"eta": eta} if eta else {}))
        progress.tick()

    stop: str | None = None
    pool = None
    ray_up = time.time()
    try:
        pool = ReplicaPool(make_actor, cfg.replicas, commit=commit, on_result=on_result, calls=calls,
                           unit_timeout=cfg.unit_timeout, max_attempts=cfg.max_unit_attempts, on_tick=progress.tick,
                           stream=stream, deliver=hand_over)
        # a resumed online run: without shards, the rows its trainer acked are done; with them (keep), the
        # committed rows are (capture.online replays the committed ones its trainer has not acked)
        done = manifest.sample_ids() | (online.consumed_ids(loc) if stream == "deliver" else set())
        records = _records(cfg, prep, summary, done, seen)
        for unit in _units(records, cfg.unit_tokens, cfg.replicas, cfg.first_unit_tokens):
            need = sum(r.num_tokens for r in unit) * per_token * (cfg.replicas + 1) + cfg.disk_reserve
            free = loc.free_bytes() if stream != "deliver" else None  # those rows never touch the disk
            if free is not None and free < need:
                stop = f"only {free / 2**20:.0f} MiB free at {cfg.out}, the next unit needs ~{need / 2**20:.0f} MiB"
                break
            pool.submit(unit)
        pool.finish()
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        stop = f"the disk at {cfg.out} is full ({e})"
    finally:
        progress.tick()
        if pool is not None:
            pool.close()
            summary.replicas = [dataclasses.asdict(s) for s in pool.stats]
            summary.quarantined = dict(pool.quarantined)
            timings.start = (ray_up - started - timings.prepare) + pool.start_seconds
            timings.engine = sum(s.engine_seconds for s in pool.stats)
            timings.write = sum(s.write_seconds for s in pool.stats)
        summary.timings = timings.as_dict()
        if retention is not None:
            summary.retained = {"limit": cfg.retain, "removed_shards": retention.removed_shards,
                                "removed_rows": retention.removed_rows, "peak_live": retention.peak_live,
                                "wait_seconds": round(retention.wait_seconds, 2)}
    summary.rejected = dict(rejected)
    manifest_now = manifest_mod.read(loc)
    summary.total_rows = manifest_now.rows
    summary.total_tokens = manifest_now.tokens
    if stream == "deliver":  # online: what this run delivered and what earlier runs' trainers acked
        summary.total_rows = summary.committed_rows + summary.already_committed
        summary.total_tokens = summary.committed_tokens
    summary.seconds = round(time.time() - started, 2)
    ended = time.time()
    if stop:
        _finish_provenance(loc, record, summary, "stopped", ended)
        raise CaptureError(
            f"stopped cleanly: {stop}; {summary.shards} shard(s) committed in this run, nothing half-written. "
            "Free some space and rerun the same command to resume"
        )
    _remove_garbage(loc)
    summary.self_check = _self_check(cfg, prep, loc, progress, record) if manifest_now.shards else None
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
        "self_check": summary.self_check,
        **({"retained": summary.retained} if summary.retained else {}),
        **({"online": stream} if stream else {}),  # deliver: committed = delivered to a trainer; tee: shards too
    })
    _finish_provenance(loc, record, summary, "complete", ended)
    if summary.total_rows == 0:
        reasons = {**summary.skipped, **summary.rejected}
        detail = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])) or "no rows read"
        raise CaptureError(f"no records written: all {summary.rows_read} rows read were dropped ({detail})")
    return summary


def self_check_rows(cfg: RunConfig, engine: str) -> int:
    """``--self-check``'s row count: as given, else 8 for vllm (states from code paths other than a plain HF
    forward) and 0 for hf and exl3 (transformers cannot load EXL3 weights: check such a run with
    ``capture shards check --model-path`` the unquantized folder)."""
    return cfg.self_check if cfg.self_check is not None else (8 if engine == "vllm" else 0)


def _self_check(cfg: RunConfig, prep: Prepared, loc: Location, progress: Progress, record: dict) -> dict | None:
    """Run :func:`provenance.check.check` on the committed run (``--self-check N`` rows); its verdict, also
    added to this invocation in ``provenance.json`` (``record``, written by ``_finish_provenance``)."""
    n = self_check_rows(cfg, prep.engine.name)
    if not n:
        return None
    from provenance.check import check

    progress.status(f"self-check: {n} rows against a float32 HF forward")
    try:
        report = check(loc, rows=n, model_path=prep.model_dir)
        verdict = {"rows": len(report.rows), "tokens": report.tokens, "dtype": report.dtype, "ok": report.ok,
                   "problems": report.problems, "argmax_agreement": report.argmax_agreement,
                   "topk_overlap": report.topk_overlap,
                   "taps": {t.column: {"cos_min": round(t.cos_min, 6), "cos_mean": round(t.cos_mean, 6),
                                       "rel_err": round(t.rel_err, 6)} for t in report.taps}}
    except Exception as e:  # noqa: BLE001 - the rows stay committed; a check that cannot run is a failed check
        reason = f"the check could not run: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        verdict = {"rows": 0, "ok": False, "problems": [reason]}
    record["invocations"][-1]["self_check"] = verdict
    if not verdict["ok"]:
        log.error("self-check FAILED on %s: %s", cfg.out, "; ".join(verdict["problems"]))
    return verdict


def _eta(elapsed: float, done: int, kept: int, rows_read: int, limit: int | None) -> str | None:
    """Time left as H:MM:SS when the rows to read are known (``--limit``): the records the engine will
    get are estimated as ``limit`` x the share of rows read so far that were kept, and the time left from
    the records it has done (``done``, rejected ones included); None otherwise. (The rows read run ahead
    of the engine by whole units, so they say nothing about the time left.)"""
    if not limit or not rows_read or not done:
        return None
    expected = max(kept, limit * kept / rows_read) if rows_read < limit else kept
    left = max(0.0, elapsed * (expected - done) / done)
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
    return {**dataclasses.asdict(cfg.filters), "limit": cfg.limit, "skip": cfg.skip, "sources": list(cfg.sources),
            "exclude_sources": list(cfg.exclude_sources), "source_caps": dict(cfg.source_caps),
            "alternation": cfg.alternation, "special_text": cfg.special_text, "system_prompt": cfg.system_prompt}

