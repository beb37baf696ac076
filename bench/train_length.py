"""Recorded experiment: is the learning curve's small end overtrained? (issue 31, part 5)

The default TrainConfig trains 600 steps of 512 blocks, 64 anchors a conversation: 4,800 conversation
visits whatever the data, ~16 epochs of 309 conversations and ~3.6 of 1,324. The learning curve's
300-conversation point (bench/learning_curve.out: 1.854, seed 0, an earlier capture) fell below the
fifth-length training (240 steps of 256 blocks, ~3.1 epochs) of 309 conversations (2.24-2.29,
bench/self_distill.out and bench/block_choice.out). Here only the length differs: the same capture
(ShareGPT rows 0-359 with the dataset's answers through the HF engine, block_choice.py's ``train-360-hf``),
the same on-policy held-out set, the same seeds; the fifth-length drafters are block_choice.py's (reused
when --work is the same folder).

    .venv/bin/python -u bench/train_length.py --work runs/learning > bench/train_length.out
"""

from __future__ import annotations

import argparse
from pathlib import Path

import frontier  # the HF-engine training capture
import self_distill  # the held-out set
from harness import header, mean_range, trained

TRAIN = "train-360-hf"
LENGTHS = {"fifth": (240, 256), "default": (600, 512)}  # name: (steps, anchors_per_step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lengths", default=",".join(LENGTHS))
    args = ap.parse_args()
    header()
    for name, cmd in (("held-every", None), (TRAIN, frontier.TRAIN)):
        s = self_distill.capture(args.work, name, cmd)
        print(f"- {name}: {s['total_rows']} rows, {s['total_tokens']:,} tokens\n    {s['cmd']}", flush=True)
    from drafter.config import TrainConfig

    table = {}
    for length in args.lengths.split(","):
        steps, per_step = LENGTHS[length]
        for seed in map(int, args.seeds.split(",")):
            # block_choice.py's drafters are the fifth-length ones: the same folder names
            name = f"{TRAIN}-s{seed}" if length == "fifth" else f"{TRAIN}-{length}-s{seed}"
            cfg = TrainConfig(run=str(args.work / TRAIN), out=str(args.work / "drafters" / name),
                              heldout_run=str(args.work / "held-every"), seed=seed, steps=steps,
                              anchors_per_step=per_step, progress=False)
            r = trained(cfg)
            table.setdefault(length, []).append((cfg, r))
            print(f"  {length} seed {seed}: drafter {r['drafter']['accept_len']:.4f}, hybrid "
                  f"{r['hybrid']['accept_len']:.4f}, lookup {r['lookup']['accept_len']:.4f} ({r['wall_s']} s)",
                  flush=True)

    print("\n| training | steps x blocks | epochs | seeds | drafter | no-match anchors | hybrid | train-set loss "
          "| lookup alone |\n|---|---|---|---|---|---|---|---|---|")
    for length, rows in table.items():
        cfg, r0 = rows[0]
        epochs = cfg.steps * cfg.anchors_per_step / cfg.anchors_per_seq / r0["data"]["train"]["conversations"]
        print(f"| {length} | {cfg.steps} x {cfg.anchors_per_step} | {epochs:.1f} | {len(rows)} "
              f"| {mean_range([r['drafter']['accept_len'] for _, r in rows])} "
              f"| {mean_range([r['drafter']['by_lookup_match']['accept_len_unmatched'] for _, r in rows])} "
              f"| {mean_range([r['hybrid']['accept_len'] for _, r in rows])} "
              f"| {mean_range([r['fixed_loss'][-1] for _, r in rows])} | {r0['lookup']['accept_len']:.3f} |")


if __name__ == "__main__":
    main()
