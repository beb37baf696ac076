"""Plan a run: resolve a :class:`capture.config.RunConfig` into what the run needs, validate it, estimate it.
Nothing here writes: every user error is raised (CaptureError) before a file is touched.

- :func:`prepare`: target, taps, dataset, model folder, tokenizer, engine and the run header.
- :func:`check_out`: what ``--out`` already holds (nothing, an empty folder, or a run this one may resume
  or extend: the same identity, arithmetic and dataset, its committed shards intact).
- :func:`estimate`: ``--dry-run``: tokens and bytes, reading and filtering exactly as the run would.

Engine rules come from the engine's declared :class:`capture.engines.base.Capabilities` and options
(:data:`capture.engines.REGISTRY`), never from its name.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pyarrow.fs as pafs

from capture.chat import ChatEncoder, load_encoder, packaged_template
from capture.config import RunConfig
from capture.dataset import DatasetRef, resolve_dataset
from capture.engines import (REGISTRY, EngineSpec, check_here, engine_class, engine_spec, resolve_engine, takers,
                             vllm_engine_args)
from capture.engines.registry import options as engine_options
from capture.regenerate import responses_header
from capture.summary import Summary
from capture.targets import Taps, Target, make_taps, model_dir, resolve_target
from common.errors import CaptureError
from common.hashing import tokenizer_sha256
from shards import codecs
from shards import format as shard_format
from shards import manifest as manifest_mod
from shards import topk as topk_mod
from shards.format import RunHeader
from shards.run import LOCK, Location, resolve

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything a run needs, resolved from its config by :func:`prepare` (no engine loaded)."""

    target: Target
    taps: Taps
    model_dir: str
    encoder: ChatEncoder
    header: RunHeader
    context_len: int | None
    dataset: DatasetRef
    engine: EngineSpec
    engine_choice: str = ""  # which engine (and vLLM path) runs, and why: "vllm, extract path (auto: ...)"


def prepare(cfg: RunConfig) -> Prepared:
    """Resolve target, taps, dataset, model folder, tokenizer and run header (no engine loaded): every
    user error is raised here, before anything is written."""
    # the engine options asked for (each differs from its declared default), and per engine the flags of them it takes
    given = [o for o in engine_options() if o.given(getattr(cfg, o.name))]
    name, why = resolve_engine(cfg.engine, {n: tuple(o.flag for o in given if o in entry.options
                                                     and takers(o.name) == (n,))  # shared ones decide nothing
                                            for n, entry in REGISTRY.items()})
    ran = run_engine(cfg.out) if cfg.engine == "auto" else None
    if ran and ran != name:  # the states of one run come from one engine
        name, why = ran, f"the run in {cfg.out} was started with it; a resume keeps its engine"
    if cfg.topk and not engine_class(name).capabilities.topk:  # an engine that cannot give top-K, wherever it runs
        able = " or ".join(n for n in REGISTRY if engine_class(n).capabilities.topk)
        raise CaptureError(f"--topk {cfg.topk}: the {name} engine cannot give top-K log-probabilities; use the {able} engine")
    check_here(name)  # then an engine that cannot run here (exl3 without CUDA), before any loading
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
    foreign = [o for o in given if o.name not in caps.options]
    if foreign:  # refused, not silently ignored
        why = f" (--engine auto: {why})" if cfg.engine == "auto" else ""
        raise CaptureError(f"{foreign[0].flag} applies only to the {' and '.join(takers(foreign[0].name))} engine; "
                           f"this run uses {name}{why}")
    engine = engine_spec(name, cfg.vllm_path, vllm_args, model_cfg, cfg.compute_dtype,
                         caps.state_dtype or target.dtype, cfg.device, cfg.gpus_per_replica, taps.final != "none")
    if cfg.responses == "regenerate" and not caps.generates:
        makers = " or ".join(n for n in REGISTRY if engine_class(n).capabilities.generates)
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
                    f"{engine.label} ({'auto: ' if cfg.engine == 'auto' else ''}{why})")


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
    """``--dtype auto`` on a resume: the engine (hf, vllm) computes in the dtype the run started with (its header's
    ``engine.compute_dtype``; absent: the state dtype), whatever this machine's ``auto`` would pick, so the
    states of one run come from one arithmetic. A ``--dtype`` given explicitly must be the run's: another
    raises CaptureError naming both."""
    if existing.header is None or existing.header.engine.get("name") != prep.engine.name:
        return prep  # another engine: check_identity refuses it; an engine without compute_dtype: None == None
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
    choice = engine.label + prep.engine_choice.removeprefix(prep.engine.label)
    return dataclasses.replace(prep, engine=engine, header=prep.header.replace(engine=engine.describe()),
                               engine_choice=choice)


def bytes_per_token(header: RunHeader, codec: str | None = None) -> float:
    """Estimated stored bytes per token: states at the codec's measured ratio, plus ids, mask, argmax and
    the top-K cells (measured bytes per kept entry, :data:`shards.topk.BYTES_PER_ENTRY`)."""
    states = header.raw_bytes_per_token * codecs.RATIO[codec or header.codec]
    return states + 4 + 1 + (4 if header.argmax else 0) + header.topk * topk_mod.BYTES_PER_ENTRY


def check_out(cfg: RunConfig, prep: Prepared) -> tuple[Location, manifest_mod.Manifest, Prepared]:
    """What ``cfg.out`` holds, checked before anything is written: ``(location, manifest, prep)``, ``prep``
    taking a resumed run's arithmetic (:func:`resume_arithmetic`). Raises CaptureError when ``--out`` is a
    file, a folder that holds files but no run, a run of another identity (target, taps, codec, ...: the
    old and new values named), or a run with committed shards missing or of another size (a
    resume would skip their rows for good). A run with nothing committed may start again."""
    loc = resolve(cfg.out)
    if loc.kind() == pafs.FileType.File:
        raise CaptureError(f"--out {cfg.out} exists and is not a folder")
    existing = manifest_mod.read(loc)
    if existing.header is None and [e for e in loc.entries() if e != LOCK]:
        raise CaptureError(f"{cfg.out} is not empty and holds no capture run ({loc.manifest_name}); "
                           "give a new or empty folder")
    if not manifest_mod.holds_nothing(loc, existing):
        prep = resume_arithmetic(cfg, prep, existing)
        manifest_mod.check_identity(cfg.out, existing, prep.header)  # checked again under the run lock
    damaged = [e["path"] for e in existing.shards if loc.size(e["path"]) != e["bytes"]]
    if damaged:
        raise CaptureError(f"{cfg.out}: {len(damaged)} committed shard(s) are missing or of another size "
                           f"({damaged[0]}); `capture shards verify {cfg.out}` lists them: restore them, or give "
                           f"them up with `capture shards repair {cfg.out}` and rerun to capture their rows again")
    return loc, existing, prep


def estimate(cfg: RunConfig) -> Summary:
    """``--dry-run``: read, tokenize and filter exactly as the run would; estimate tokens and bytes
    (regenerate mode: the prompt tokens plus the whole generation budget, an upper bound). Writes nothing."""
    from capture.work import records

    loc, m, prep = check_out(cfg, prepare(cfg))
    manifest_mod.check_dataset(m, dataclasses.asdict(prep.dataset))  # the run checks it as it records it
    summary = Summary(out=cfg.out, engine=prep.engine_choice)
    seen = m.token_hashes() if cfg.filters.dedup else set()
    budget = cfg.max_new_tokens if cfg.responses == "regenerate" else 0
    feed = records(cfg, prep.encoder, prep.dataset, prep.context_len, summary, m.sample_ids(), seen)
    tokens = sum(r.num_tokens + budget * getattr(r, "turns", 0) for r in feed)
    summary.estimated_tokens = tokens
    summary.estimated_bytes = int(tokens * bytes_per_token(prep.header))
    summary.estimated_bytes_by_codec = {c: int(tokens * bytes_per_token(prep.header, c)) for c in codecs.CODECS}
    summary.free_bytes = loc.free_bytes()  # None on an object store
    summary.total_rows = m.rows
    return summary


def filter_settings(cfg: RunConfig) -> dict:
    """Every setting that decides which dataset rows become records (for provenance.json)."""
    return {**dataclasses.asdict(cfg.filters), "limit": cfg.limit, "skip": cfg.skip, "sources": list(cfg.sources),
            "exclude_sources": list(cfg.exclude_sources), "source_caps": dict(cfg.source_caps),
            "alternation": cfg.alternation, "special_text": cfg.special_text, "system_prompt": cfg.system_prompt}
