"""How to batch an HF prefill on a CPU: one record per forward, right-padded batches, or packed groups.

The same real ShareGPT conversations (SmolLM2's chat template, cut to --max-tokens, longest first) through
SmolLM2's decoder (``model.model``: every layer, no LM head, no capture code), three ways:
  alone      : one record per forward, no mask (what the HF engine does by default)
  padded N   : right-padded batches of at most N padded tokens (capture.replica.length_batches), a mask
  packed N   : records concatenated into forwards of at most N tokens, positions restarting per record
               (transformers builds the block-diagonal causal mask; the engine's pack_tokens=N)
Interleaved repeats, the median reported, as tokens per CPU-second of this process (all its threads)
and tokens per wall second.

    python bench/packing.py [--rows 40] [--max-tokens 1024] [--repeats 2] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import numpy as np
import torch

from harness import encoded, header, interleaved, smollm2, torch_cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    header()

    from transformers import AutoModelForCausalLM

    from capture.engines.hf import pack_groups
    from capture.replica import length_batches
    from common.records import Tokenized

    mdir = str(smollm2())
    recs = [r.input_ids[: args.max_tokens] for _, r in itertools.islice(encoded(mdir), args.rows * 2)
            if not isinstance(r, str)][: args.rows]
    recs.sort(key=len, reverse=True)
    tokens = sum(map(len, recs))
    as_long = [torch.from_numpy(r.astype(np.int64)) for r in recs]

    def alone(m) -> None:
        for ids in as_long:
            m.model(input_ids=ids[None], use_cache=False)

    def padded(m, batch_tokens: int) -> None:
        tk = [Tokenized(str(i), i, "s", r, np.ones(len(r), bool)) for i, r in enumerate(recs)]
        for b in length_batches(tk, batch_tokens):
            width = b[0].num_tokens
            ids = torch.zeros(len(b), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, t in enumerate(b):
                ids[i, : t.num_tokens] = as_long[int(t.sample_id)]
                mask[i, : t.num_tokens] = 1
            m.model(input_ids=ids, attention_mask=mask, use_cache=False)

    def packed(m, pack_tokens: int) -> None:
        for g in pack_groups([len(r) for r in recs], pack_tokens):
            ids = torch.cat([as_long[i] for i in g])[None]
            pos = torch.cat([torch.arange(len(recs[i])) for i in g])[None]
            m.model(input_ids=ids, position_ids=pos, use_cache=False)

    ways = [("alone", alone), ("padded 8192", lambda m: padded(m, 8192)), ("padded 2048", lambda m: padded(m, 2048))]
    ways += [(f"packed {n}", lambda m, n=n: packed(m, n)) for n in (512, 1024, 2048)]
    print(f"SmolLM2-135M decoder, {len(recs)} ShareGPT conversations, {tokens:,} tokens (<= {args.max_tokens} each, "
          f"{min(map(len, recs))}-{max(map(len, recs))}), {torch.get_num_threads()} threads, {torch_cpu()}; "
          f"median of {args.repeats} interleaved runs")
    print()
    print("| dtype | way | tokens per CPU-second | tokens/s | vs alone (CPU-s) |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        model = AutoModelForCausalLM.from_pretrained(mdir, dtype=getattr(torch, dtype)).eval()
        with torch.inference_mode():
            wall, cpu = interleaved({name: lambda fn=fn: fn(model) for name, fn in ways}, args.repeats)
        base = statistics.median(tokens / s for s in cpu["alone"])
        for name, _ in ways:
            med = statistics.median(tokens / s for s in cpu[name])
            print(f"| {dtype} | {name} | {med:,.1f} | {statistics.median(tokens / s for s in wall[name]):,.1f} "
                  f"| {med / base:.2f}x |")


if __name__ == "__main__":
    main()
