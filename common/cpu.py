"""Does this CPU compute a 16-bit float type natively? One owner for the HF engine's ``--dtype auto``
(:func:`capture.engines.compute_dtype`, the hf and vllm engines) and the drafter trainer's ``--precision auto``
(:func:`drafter.evaluate.resolve_precision`).

oneDNN, not ATen's dispatch, runs a bf16 linear layer on a CPU: with native dot products (x86 AVX-512 BF16
or AMX; aarch64 ``bf16``) it beats float32, without them (AVX2, AVX-512 without BF16) it emulates them and
runs several times slower (bench/compute_dtype.out: SmolLM2-135M prefill on an AVX2-only CPU, bf16 0.17x
float32 per token; docs/drafter.md: a drafter training step of 256 blocks, 29 s under bf16 autocast, 1.1 s in float32).
"""

from __future__ import annotations

import functools
import os
import platform

# CPU feature flags (Linux /proc/cpuinfo: x86 "flags", aarch64 "Features") that give a 16-bit type
# native dot products: (x86, aarch64)
NATIVE = {"bfloat16": ({"avx512_bf16", "amx_bf16"}, {"bf16"}),
          "float16": ({"avx512_fp16", "amx_fp16"}, {"asimdhp"})}


def cpu_features(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags (``/proc/cpuinfo``'s ``flags`` line on x86, ``Features`` on aarch64, or the
    text ``cpuinfo``); None where there is no such file (macOS, Windows)."""
    if cpuinfo is None:
        cpuinfo = _proc_cpuinfo()
        if cpuinfo is None:
            return None
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


@functools.cache
def _proc_cpuinfo() -> str | None:
    """``/proc/cpuinfo``, read once a process (the trainer asks at every forward); None where absent."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return None


def native(dtype: str, features: set[str] | None = None, max_isa: str | None = None,
           machine: str | None = None) -> bool | None:
    """Whether ``dtype`` (a key of :data:`NATIVE`) has native dot products on this CPU: on x86 one of its
    flags, unless oneDNN is capped below it (``ONEDNN_MAX_CPU_ISA``, e.g. ``AVX2``: ``max_isa``); on
    aarch64 its feature. None where it cannot be told (no ``/proc/cpuinfo``, another architecture).
    ``features``, ``max_isa`` and ``machine`` default to this machine's. Raises KeyError for another dtype."""
    x86, arm = NATIVE[dtype]
    features = cpu_features() if features is None else features
    if features is None:
        return None
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64", "i686"):
        isa = (max_isa if max_isa is not None else os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL")).upper()
        capped = isa != "ALL" and not any(k in isa for k in ("BF16", "FP16", "AMX", "AVX10"))
        return bool(features & x86) and not capped
    if machine in ("aarch64", "arm64"):
        return bool(features & arm)
    return None
