"""Recorded drafter run: capture SmolLM2 states of ShareGPT, train a drafter with 3 seeds, score it.

    python bench/drafter_run.py [--out /tmp/drafter-run] [--limit 320] [--steps 400]

1. ``capture run --target smollm2-135m --dataset sharegpt --layers 3,15,27 --max-tokens 1024
   --overlength truncate --limit 360`` (rerunning resumes: a finished capture is not redone);
2. trains 3 drafters (seeds 0, 1, 2; the default TrainConfig otherwise) on the train split;
3. prints held-out acceptance length (accepted drafted tokens per block, no bonus; drafter.metrics) and
   first-token accuracy for each seed and for the baselines (untrained drafter of the same seed, bigram
   over the target's greedy tokens fitted on the train split), and whether the worst seed beats the better
   baseline by more than the spread across seeds.
Output of the recorded run: bench/drafter_run.out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from drafter.config import TrainConfig  # noqa: E402
from drafter.train import load_data, train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/drafter-run")
    ap.add_argument("--limit", type=int, default=360)
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()

    cmd = [sys.executable, "-m", "cli", "run", "--target", "smollm2-135m", "--dataset", "sharegpt",
           "--layers", "3,15,27", "--max-tokens", "1024", "--overlength", "truncate", "--limit", str(args.limit),
           "--out", args.out, "--no-progress", "--json"]
    print("$ capture " + " ".join(cmd[3:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"capture failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    s = json.loads(proc.stdout)
    capture_s = time.perf_counter() - t0
    print(f"capture: {s['committed_rows']} rows committed now ({s['already_committed']} already), run total "
          f"{s['total_rows']} rows, {s['total_tokens']:,} tokens; skipped {s['skipped']}; {capture_s:.0f} s "
          f"(this invocation)", flush=True)

    t0 = time.perf_counter()
    d = load_data(args.out, TrainConfig.heldout_fraction)
    n_train, n_held = len(d.train["sample_ids"]), len(d.heldout["sample_ids"])
    print(f"load: {n_train} train / {n_held} held-out conversations, {len(d.train['input_ids']):,} / "
          f"{len(d.heldout['input_ids']):,} tokens, taps {list(d.train['taps'].shape[1:])}; "
          f"{time.perf_counter() - t0:.0f} s", flush=True)

    results = {}
    for seed in map(int, args.seeds.split(",")):
        cfg = TrainConfig(run=args.out, out=f"{args.out}-drafter/seed{seed}", seed=seed, steps=args.steps,
                          progress=False)
        t0 = time.perf_counter()
        results[seed] = r = train(cfg, d)
        print(f"seed {seed}: loss {r['fixed_loss'][0]:.3f} -> {r['fixed_loss'][1]:.3f}, training {r['seconds']} s, "
              f"with evals {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\nconfig: {json.dumps({k: v for k, v in cfg.__dict__.items() if k not in ('run', 'out', 'seed')})}")
    print(f"held-out blocks scored: {r['drafter']['blocks']} (block size {cfg.block_size})\n")

    def row(name, sc):
        print(f"{name:22s} {sc['accept_len']:10.4f} {sc['accept_len_with_bonus']:12.4f} {sc['first_token_acc']:10.4f}")

    print(f"{'model':22s} {'accept_len':>10s} {'+bonus':>12s} {'first_acc':>10s}")
    for seed, r in results.items():
        row(f"drafter seed {seed}", r["drafter"])
    for seed, r in results.items():
        row(f"untrained seed {seed}", r["untrained"])
    row("bigram (train split)", r["bigram"])

    scores = [r["drafter"]["accept_len"] for r in results.values()]
    spread = max(scores) - min(scores)
    best_base = max([r["bigram"]["accept_len"]] + [r["untrained"]["accept_len"] for r in results.values()])
    margin = min(scores) - best_base
    print(f"\nmean accept_len {sum(scores) / len(scores):.4f}, spread across seeds {spread:.4f}; "
          f"better baseline {best_base:.4f}; worst seed beats it by {margin:.4f}: "
          f"{'PASS' if margin > spread else 'FAIL'} (margin > spread)")
    print("per-position accuracy, seed 0: " + ", ".join(f"{a:.3f}" for a in results[0]["drafter"]["position_acc"]))


if __name__ == "__main__":
    main()
