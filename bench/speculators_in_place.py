"""speculators reading a run in place (the `capture` hidden-states backend, shards/speculators.py) vs its
`file` backend over `capture export`'s files: items per second per core and disk, for bf16-split and
int4-b32 (issue 32).

    python bench/speculators_in_place.py --work /tmp/spec-bench [--passes 3]

Makes (once, reused): a run of the first 60 ShareGPT rows through SmolLM2 (taps 3,15,27, --final
pre-norm, <= 1,024 tokens) in bf16-split, its int4-b32 recode, the full speculators export of each and the
`--no-states` index of each. Then, in one process with one torch thread (numbers are per core), reads every
item of speculators' own `ArrowDataset` (`ds[i]`: what its DataLoader workers call) with the `file`
backend and with the `capture` backend, warm (one untimed pass first), median of --passes interleaved passes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from harness import capture_run, header


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    header()
    torch.set_num_threads(1)
    from shards.export import export
    from shards.manifest import read as read_manifest
    from shards.recode import recode
    from shards.speculators import RunTransfer
    from speculators.train.data import ArrowDataset

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    runs = {"bf16-split": work / "run-bf16", "int4-b32": work / "run-int4"}
    if not (read_manifest(runs["bf16-split"]).complete if runs["bf16-split"].exists() else False):
        _, shown = capture_run("--target", "smollm2-135m", "--dataset", "sharegpt", "--limit", "60", "--layers",
                               "3,15,27", "--final", "pre-norm", "--max-tokens", "1024", "--overlength", "truncate",
                               "--codec", "bf16-split", "--no-progress", "--out", runs["bf16-split"])
        print(f"- {shown.replace(str(work), '$WORK')}")
    if not runs["int4-b32"].exists():
        recode(runs["bf16-split"], runs["int4-b32"], "int4-b32")
    datasets, disk = {}, {}
    for codec, run in runs.items():
        files, index = work / f"files-{codec}", work / f"index-{codec}"
        if not (files / "export.json").exists():
            export(run, files, "speculators")
        if not (index / "export.json").exists():
            export(run, index, "speculators", states=False)
        datasets[f"{codec}: file backend (exported files)"] = ArrowDataset(max_len=4096, datapath=str(files),
                                                                          on_missing="raise")
        datasets[f"{codec}: capture backend (in place)"] = ArrowDataset(
            max_len=4096, datapath=str(index), transfer=RunTransfer(index), on_missing="raise")
        disk[codec] = {"run shards": du(run), "export (files + dataset)": du(files), "index (no states)": du(index)}
    n = len(next(iter(datasets.values())))
    tokens = sum(next(iter(datasets.values())).approx_lengths)
    for ds in datasets.values():  # warm: page cache, imports, shard maps
        for i in range(n):
            ds[i]
    times: dict[str, list[float]] = {k: [] for k in datasets}
    for _ in range(args.passes):
        for name, ds in datasets.items():
            t0 = time.perf_counter()
            for i in range(n):
                ds[i]
            times[name].append(time.perf_counter() - t0)
    print(f"\n{n} items, {tokens:,} tokens; one torch thread; median of {args.passes} passes\n")
    print(f"{'reader':<48} {'items/s':>9} {'tokens/s':>11}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:<48} {n / t:>9.1f} {tokens / t:>11,.0f}")
    print(f"\n{'disk (MiB)':<16} " + " ".join(f"{k:>26}" for k in next(iter(disk.values()))))
    for codec, d in disk.items():
        print(f"{codec:<16} " + " ".join(f"{v / 2**20:>26,.1f}" for v in d.values()))
    print("\nin place: what a team keeps is the run (shards) plus the index; exported: the run plus the export")


if __name__ == "__main__":
    main()
