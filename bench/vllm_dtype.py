"""vLLM-CPU capture in bf16 and in float32 arithmetic on this CPU (what ``capture run --engine vllm --dtype
auto`` picks by): the extract path, compiled, argmax on, as ``capture run`` runs it; the hf engine (its own
``--dtype auto``) beside it. Only the engine call is timed, after a warm-up batch, each engine in a process
of its own (bench/vllm_capture.py's harness); the states are stored in bf16 either way.

    OMP_NUM_THREADS=2 .venv/bin/python bench/vllm_dtype.py --conversations 16 > bench/vllm_dtype.out
"""

from __future__ import annotations

import os

from vllm_capture import _hf, _spawn, _vllm, prefill_batch


def main() -> None:
    _, mdir, batch = prefill_batch(__doc__.splitlines()[0], 16)
    from capture.engines import compute_dtype
    from common.cpu import cpu_features

    flags = sorted((cpu_features() or set()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"# {len(batch)} ShareGPT conversations, {sum(map(len, batch)):,} tokens; CPU flags {flags}; "
          f"--dtype auto picks {compute_dtype('auto', 'bfloat16')}; {os.cpu_count()} CPUs")
    auto = compute_dtype("auto", "bfloat16")
    rows = [(f"hf capture, {auto} (auto)", _spawn(_hf, mdir, batch, True, 8192, auto))]
    for dtype in ("bfloat16", "float32"):
        rows.append((f"vllm capture, {dtype}", _spawn(_vllm, mdir, "extract", False, batch, True, dtype)))
    base = rows[1][1][1] / rows[1][1][0]
    print(f"{'engine':28} {'seconds':>8} {'tok/s':>8} {'vs vllm bf16':>12}")
    for name, (secs, n) in rows:
        print(f"{name:28} {secs:8.1f} {n / secs:8.0f} {n / secs / base:11.2f}x")


if __name__ == "__main__":
    main()
