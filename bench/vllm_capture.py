"""Prefill throughput on CPU: HF capture, vLLM plain prefill, vLLM capture (extract and hooks paths).

The capture overhead is capture tokens/s over plain-prefill tokens/s of the same engine settings (the
same compile mode, same max_num_batched_tokens, prefix caching off), on the same token ids: real ShareGPT
conversations through the SmolLM2 chat template. Only the engine call is timed (no shard writing), after
a warm-up batch; each vLLM engine runs in a process of its own.

    OMP_NUM_THREADS=2 .venv/bin/python bench/vllm_capture.py --conversations 48 > bench/vllm_capture.out
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import multiprocessing
import os
import time

import numpy as np

from harness import encoded, header, smollm2, smollm2_taps

LAYERS = (3, 15, 27)
WARM = 2  # conversations in the warm-up call


def _vllm(model_dir: str, mode: str, eager: bool, batch: list[np.ndarray], argmax: bool,
          dtype: str = "bfloat16") -> tuple[float, int]:
    """Seconds for one prefill of ``batch`` (after a warm-up) in a fresh vLLM engine computing in ``dtype``
    (states stored in bf16); mode plain|extract|hooks."""
    common = {"max_model_len": 4096, "enable_prefix_caching": False, "enforce_eager": eager}
    if mode == "plain":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=model_dir, dtype=dtype, kv_cache_memory_bytes=1 << 30, seed=0, **common)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1 if argmax else None)

        def run(b):
            return llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in x]) for x in b], params, use_tqdm=False)
    else:
        from capture.engines.vllm import VLLMEngine

        eng = VLLMEngine(model_dir, smollm2_taps(LAYERS, "post-norm"), argmax=argmax, path=mode, engine_args=common,
                         compute_dtype=None if dtype == "bfloat16" else dtype)
        run = eng.forward
    run(batch[:WARM])
    start = time.perf_counter()
    run(batch)
    return time.perf_counter() - start, sum(len(x) for x in batch)


def _hf(model_dir: str, batch: list[np.ndarray], argmax: bool, batch_tokens: int = 8192,
        dtype: str = "bfloat16") -> tuple[float, int]:
    from capture.engines.hf import HFEngine

    eng = HFEngine(model_dir, smollm2_taps(LAYERS, "post-norm"), argmax=argmax, threads=2, dtype=dtype,
                   state_dtype="bfloat16")
    eng.forward(batch[:WARM])
    ordered = sorted(batch, key=len, reverse=True)  # the replica's length batching
    groups, cur = [], []
    for x in ordered:
        if cur and (len(cur) + 1) * len(cur[0]) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(x)
    groups.append(cur)
    start = time.perf_counter()
    for g in groups:
        eng.forward(g)
    return time.perf_counter() - start, sum(len(x) for x in batch)


def _spawn(fn, *args):
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


def prefill_batch(description: str, conversations: int) -> tuple[argparse.Namespace, str, list[np.ndarray]]:
    """The bench's command line (``--conversations``, default ``conversations``; ``--max-tokens``), its header
    printed, SmolLM2's folder and the first ShareGPT conversations within ``--max-tokens`` as token ids."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--conversations", type=int, default=conversations)
    ap.add_argument("--max-tokens", type=int, default=2048, help="skip longer conversations")
    args = ap.parse_args()
    header(env=("OMP_NUM_THREADS",))
    mdir = str(smollm2())
    kept = (r.input_ids for _, r in encoded(mdir) if not isinstance(r, str) and r.num_tokens <= args.max_tokens)
    return args, mdir, list(itertools.islice(kept, args.conversations))


def main() -> None:
    args, mdir, batch = prefill_batch(__doc__.splitlines()[0], 48)
    tokens = sum(len(x) for x in batch)
    print(f"# {len(batch)} ShareGPT conversations, {tokens:,} tokens (template-rendered, <= {args.max_tokens} each); "
          f"taps {LAYERS} + post-norm final; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
          f"{os.cpu_count()} CPUs")
    rows = []
    for argmax in (False, True):
        hf = _spawn(_hf, mdir, batch, argmax)
        rows.append(("hf capture", "eager", argmax, hf, None))
        for eager in (False, True):
            plain = _spawn(_vllm, mdir, "plain", eager, batch, argmax)
            rows.append(("vllm plain prefill", "eager" if eager else "compiled", argmax, plain, None))
            mode = "hooks" if eager else "extract"
            cap = _spawn(_vllm, mdir, mode, eager, batch, argmax)
            rows.append((f"vllm capture ({mode})", "eager" if eager else "compiled", argmax, cap,
                         (plain[1] / plain[0], cap[1] / cap[0])))
    print(f"{'engine':26} {'mode':9} {'argmax':6} {'seconds':>8} {'tok/s':>8} {'vs plain':>8}")
    for name, mode, argmax, (secs, n), ratio in rows:
        rel = f"{ratio[1] / ratio[0]:.3f}x" if ratio else ""
        print(f"{name:26} {mode:9} {str(argmax):6} {secs:8.1f} {n / secs:8.0f} {rel:>8}")


if __name__ == "__main__":
    main()
