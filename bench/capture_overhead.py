"""Capture throughput against the same engine's plain forward, and bytes per token.

Same tokens, same model: real ShareGPT conversations through SmolLM2's chat template.
  plain   : the cheapest correct forward: each conversation alone, unpadded, the standard HF forward
            (model(ids[None]).logits.argmax(-1)): every layer and the LM head, as computing argmax
            needs, nothing kept
  capture : Replica.process + finish (the HF engine prefills one record per forward too) — hooks on the
            taps, argmax in 1,024-token chunks, validation, the writer thread encoding cells (--codec) and
            writing fsync'd shards
Runs are interleaved (plain, capture, plain, capture, ...) and the median of 3 is reported.

    python bench/capture_overhead.py [--rows 40] [--max-tokens 1024] [--layers 3,15,27] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from harness import encoded, header, interleaved, smollm2, workdir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--layers", default="3,15,27")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--codec", default="bf16-split")
    args = ap.parse_args()
    header()

    from capture.chat import load_encoder
    from common.hashing import tokenizer_sha256
    from capture.replica import Replica
    from capture.targets import PRESETS, make_taps
    from filters import FilterConfig, apply_filters
    from shards import format as shard_format

    target = PRESETS["smollm2-135m"]
    taps = make_taps(target, tuple(int(k) for k in args.layers.split(",")), "none")
    mdir = smollm2()
    enc = load_encoder(str(mdir))
    filt = FilterConfig(max_tokens=args.max_tokens, overlength="truncate")
    recs = []
    for _, rec in encoded(mdir, specials=True):
        if not isinstance(rec, str) and (rec := apply_filters(rec, filt, set())[0]) is not None:
            recs.append(rec)
        if len(recs) == args.rows:
            break
    tokens = sum(r.num_tokens for r in recs)
    shard_header = shard_format.header(
        target={"name": target.name}, taps=taps.describe(), columns=list(taps.columns),
        hidden_size=target.hidden_size, dtype="bfloat16", codec=args.codec, argmax=True,
        chat_template=enc.template, chat_template_sha256=enc.template_sha256,
        tokenizer_sha256=tokenizer_sha256(enc.tokenizer))
    threads = torch.get_num_threads()
    out = workdir("capture-bench-")
    replica = Replica(str(mdir), taps, shard_header, str(out), shard_size=64 * 2**20, batch_tokens=args.batch_tokens,
                      threads=threads)
    replica.start()
    model = replica.engine.model
    inputs = [torch.from_numpy(r.input_ids.astype(np.int64))[None] for r in recs]

    @torch.inference_mode()
    def plain() -> None:
        for ids in inputs:
            model(input_ids=ids, use_cache=False).logits.argmax(-1)

    def capture() -> None:
        replica.process(recs)
        replica.finish()

    plain()  # warm-up
    times, _ = interleaved({"plain": plain, "capture": capture}, args.repeats)
    shard_bytes = sum(p.stat().st_size for p in out.glob("shard-*.arrow"))
    raw_state = tokens * len(taps.columns) * target.hidden_size * 2
    p, c = statistics.median(times["plain"]), statistics.median(times["capture"])
    print(f"SmolLM2-135M bf16 on {threads} CPU threads; {len(recs)} ShareGPT conversations, {tokens:,} tokens "
          f"(≤{args.max_tokens} each), taps {args.layers}, argmax on, one conversation per forward, "
          f"codec {args.codec}")
    print()
    print("| path | median s | tokens/s | runs (s) |")
    print("|---|---|---|---|")
    for name, med in (("plain forward", p), ("capture (hooks + argmax + shards)", c)):
        runs = ", ".join(f"{x:.2f}" for x in times["plain" if name.startswith("plain") else "capture"])
        print(f"| {name} | {med:.2f} | {tokens / med:,.0f} | {runs} |")
    print()
    print(f"capture / plain throughput: {p / c:.3f}x (gate >= 0.90x, target >= 0.95x)")
    print(f"bytes per token on disk: {shard_bytes / (tokens * args.repeats):,.1f} "
          f"(raw bf16 states {raw_state / tokens:,.0f} + ids/mask/argmax; ratio to raw states "
          f"{shard_bytes / args.repeats / raw_state:.3f})")


if __name__ == "__main__":
    main()
