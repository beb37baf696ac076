"""What `capture run --dtype` buys on this CPU: the HF engine's forward in bf16 and in float32, tokens per
CPU-second, one thread, on real ShareGPT conversations through SmolLM2-135M (taps 3/15/27, post-norm final,
argmax: `HFEngine.forward`, one record per forward), and how far the stored bf16 states of a float32
forward are from those of a bf16 forward (per-token cosine against a float32 reference: the float32
forward rounded to bf16 is the closer one). Runs are interleaved (bf16, float32, bf16, ...) and the median
of the repeats is reported. ``--dtype auto`` picks bf16 only where the CPU has native bf16 dot products.

    python bench/compute_dtype.py [--rows 8] [--max-tokens 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from harness import encoded, header, interleaved, smollm2, smollm2_taps, torch_cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    header()
    torch.set_num_threads(1)

    from capture.engines import compute_dtype
    from capture.engines.hf import HFEngine

    mdir = str(smollm2())
    records = [r.input_ids[: args.max_tokens] for _, r in itertools.islice(encoded(mdir), 4 * args.rows)
               if not isinstance(r, str)][: args.rows]
    tokens = sum(len(r) for r in records)
    taps = smollm2_taps((3, 15, 27), "post-norm")
    engines = {d: HFEngine(mdir, taps, dtype=d, state_dtype="bfloat16") for d in ("bfloat16", "float32")}

    def forwards(eng) -> None:
        for ids in records:
            eng.forward([ids])

    _, cpu = interleaved({d: lambda eng=eng: forwards(eng) for d, eng in engines.items()}, args.repeats)
    rates = {d: [tokens / s for s in secs] for d, secs in cpu.items()}

    ref = HFEngine(mdir, taps, dtype="float32")  # float32 states: the reference both are compared with
    cos: dict[str, list[torch.Tensor]] = {d: [] for d in engines}
    for ids in records:
        want = ref.forward([ids])[0].states
        for d, eng in engines.items():
            got = eng.forward([ids])[0].states
            cos[d] += [torch.nn.functional.cosine_similarity(got[c].float(), want[c], dim=-1) for c in want]

    print(f"# {torch_cpu()}; one thread")
    print(f"# {len(records)} ShareGPT conversations, {tokens:,} tokens (<= {args.max_tokens} each), one per forward; "
          f"median of {args.repeats} interleaved repeats")
    print(f"# --dtype auto here: {compute_dtype('auto', 'bfloat16')}\n")
    print("| compute dtype | tokens per CPU-second | vs float32 | stored bf16 states vs float32 reference: per-token cosine mean / min |")
    print("|---|---|---|---|")
    f32 = statistics.median(rates["float32"])
    for d in engines:
        c = torch.cat(cos[d])
        print(f"| {d} | {statistics.median(rates[d]):,.1f} | {statistics.median(rates[d]) / f32:.2f}x "
              f"| {c.mean():.6f} / {c.min():.6f} |")


if __name__ == "__main__":
    main()
