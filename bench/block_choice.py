"""Recorded experiment: does the drafter beat prompt lookup once it drafts whole blocks from the copy? (issue 31, part 5)

bench/learning_curve.out found the drafter about as accurate as prompt lookup slot by slot but 23% behind
it on the anchors lookup copies from: its per-slot argmaxes leave a copy in the middle of a run. Here the
same trained drafters are scored with block-level choices between their draft and lookup's
(drafter.evaluate.BLOCK_CHOICES): "commit" (lookup's block where the drafter's own slot-1 token is the
copied one, the drafter's elsewhere: no new parameters, the drafter's first choice decides), "hybrid"
(lookup's block wherever it has a match) and the "oracle" (the better block of the two against the labels:
the ceiling of any such choice), beside the drafter alone and prompt lookup alone.

Drafters: ShareGPT rows 0-359 with the dataset's answers through the HF engine (bench/frontier.py's
training capture), self_distill.py's fifth-length training (240 steps of 256 blocks), 3 seeds, scored on
the on-policy held-out set (rows 3000-3119, every turn answered by the target through vLLM).

    .venv/bin/python -u bench/block_choice.py --work runs/learning > bench/block_choice.out

Captures and drafters already complete under --work are reused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import frontier  # the HF-engine training capture
import self_distill  # the held-out set and the fifth-length training
from harness import header, mean_range, trained

TRAIN = "train-360-hf"
SEEDS = (0, 1, 2)
SHOWN = ("drafter", "commit", "hybrid", "oracle", "lookup")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    args = ap.parse_args()
    header()
    args.work.mkdir(parents=True, exist_ok=True)
    for name, cmd in (("held-every", None), (TRAIN, frontier.TRAIN)):
        s = self_distill.capture(args.work, name, cmd)
        print(f"- {name}: {s['total_rows']} rows, {s['total_tokens']:,} tokens; skipped {s['skipped']}\n"
              f"    {s['cmd']}", flush=True)
    from drafter.config import TrainConfig

    results = []
    for seed in SEEDS:
        r = trained(TrainConfig(run=str(args.work / TRAIN), out=str(args.work / "drafters" / f"{TRAIN}-s{seed}"),
                                heldout_run=str(args.work / "held-every"), seed=seed, steps=240,
                                anchors_per_step=256, progress=False))
        results.append(r)
        print(f"  seed {seed}: {r['data']['train']['conversations']} conversations, "
              f"{r['data']['train']['anchors']:,} anchors; "
              + ", ".join(f"{k} {r[k]['accept_len']:.4f}" for k in SHOWN) + f" ({r['wall_s']} s)", flush=True)
    report(results)


def report(results: list[dict]) -> None:
    """Per way of drafting: accept_len, first-token accuracy, the split by lookup match (mean (min-max) over
    seeds) and the seeds on which it beats prompt lookup alone."""
    look = results[0]["lookup"]
    share = look["by_lookup_match"]["share"]
    print(f"\non-policy held-out set: {results[0]['data']['heldout']}; {share:.1%} of its anchors have a "
          f"prompt-lookup match\naccepted drafted tokens per block of 8 ({len(results)} seeds: mean (min-max))\n")
    print("| drafting | accept_len | first-token | lookup-matched anchors | no match | beats lookup alone |")
    print("|---|---|---|---|---|---|")
    for k in SHOWN:
        split = [r[k]["by_lookup_match"] for r in results]
        wins = "" if k == "lookup" else f"{sum(r[k]['accept_len'] > r['lookup']['accept_len'] for r in results)}/{len(results)}"
        print(f"| {k} | {mean_range([r[k]['accept_len'] for r in results])} "
              f"| {mean_range([r[k]['first_token_acc'] for r in results])} "
              f"| {mean_range([s['accept_len_matched'] for s in split])} "
              f"| {mean_range([s['accept_len_unmatched'] for s in split])} | {wins} |")


if __name__ == "__main__":
    main()
