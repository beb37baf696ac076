"""EXL3 engine check (CUDA machines): capture the same records with ``--engine exl3`` (exllamav3, an EXL3
model folder) and with the HF engine (the unquantized checkpoint of the same model, ``device_map="auto"``)
and compare every tap per token.

    python bench/exl3_check.py --exl3 /models/GLM-5.3-Flash-exl3-4bpw --hf /models/GLM-5.3-Flash \
        --layers 5,14,24,33,42 --final post-norm --dataset ../shared/data/open-perfectblend-sample.jsonl \
        --limit 8 > bench/exl3_check.out

Prints, per column, the mean / min per-token cosine and the max |difference| relative to the HF state's
RMS, the number of fp16 values at the ±65504 clamp, the argmax agreement, and PASS/FAIL against
``--min-cosine`` (default 0.98: 4-bpw weights are not expected to match bf16 bit for bit). Exit codes: 0 pass,
1 a check failed, 2 the machine cannot run it (no CUDA device, no exllamav3), with one line on stderr.
The token ids both engines see come from the HF folder's tokenizer and chat template (capture.chat).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

from harness import encoded, header


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exl3", required=True, help="EXL3 model folder (exllamav3 format)")
    ap.add_argument("--hf", required=True, help="unquantized HF checkpoint of the same model (reference)")
    ap.add_argument("--layers", default="5,14,24,33,42")
    ap.add_argument("--final", default="post-norm", choices=["none", "post-norm", "pre-norm"])
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--limit", type=int, default=8, help="records to compare")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--min-cosine", type=float, default=0.98)
    args = ap.parse_args()

    from common.errors import CaptureError

    try:
        from capture.engines.exl3 import check_exl3

        check_exl3()  # before loading anything: no CUDA / no exllamav3 is a clear one-line exit 2
        return run(args)
    except CaptureError as e:
        print(f"exl3_check: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    header()
    import numpy as np
    import torch

    from capture.engines.exl3 import FP16_CLAMP, EXL3Engine
    from capture.engines.hf import HFEngine
    from capture.targets import make_taps, parse_layers, resolve_target

    target = resolve_target(args.hf)
    taps = make_taps(target, parse_layers(args.layers), args.final)
    records = []
    for _, r in encoded(args.hf, args.dataset, specials=True):
        if not isinstance(r, str) and r.num_tokens <= args.max_tokens:
            records.append(r.input_ids)
        if len(records) == args.limit:
            break
    print(f"target {target.name} ({target.architecture}, {target.num_layers} layers, {target.residual_streams} "
          f"stream(s)); taps {list(taps.layers)} final {taps.final}; {len(records)} records, "
          f"{sum(map(len, records))} tokens; torch {torch.__version__}, {torch.cuda.get_device_name(0)}")

    t = time.time()
    exl3 = EXL3Engine(args.exl3, taps, argmax=True, num_layers=target.num_layers)
    got = exl3.forward(records)
    print(f"exl3: {time.time() - t:.1f} s (load + prefill)")
    del exl3
    torch.cuda.empty_cache()
    t = time.time()
    hf = HFEngine(args.hf, taps, argmax=True, dtype="bfloat16", device_map="auto")
    ref = list(itertools.chain.from_iterable(hf.forward([ids]) for ids in records))
    print(f"hf:   {time.time() - t:.1f} s (load + prefill)")

    ok = True
    for col in taps.columns:
        cos, rel, clamped = [], [], 0
        for g, r in zip(got, ref):
            a, b = g.states[col].float(), r.states[col].float()
            assert g.states[col].dtype == torch.float16, g.states[col].dtype
            cos.append(torch.nn.functional.cosine_similarity(a, b, dim=-1))
            rel.append(((a - b).abs().amax(-1) / b.pow(2).mean(-1).sqrt().clamp_min(1e-6)))
            clamped += int((a.abs() >= FP16_CLAMP).sum())
        cos, rel = torch.cat(cos), torch.cat(rel)
        passed = cos.min().item() >= args.min_cosine
        ok &= passed
        print(f"{col:>8}: cosine mean {cos.mean():.5f} min {cos.min():.5f}; max |diff|/rms {rel.max():.3f}; "
              f"clamped values {clamped}; {'PASS' if passed else 'FAIL'}")
    agree = np.mean(np.concatenate([g.argmax == r.argmax for g, r in zip(got, ref)]))
    print(f"  argmax: agreement {agree:.4f}")
    print(json.dumps({"pass": bool(ok), "argmax_agreement": float(agree)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
