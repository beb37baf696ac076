"""speculators and SpecForge reading a run in place vs from `capture export`'s files: items per second
per core and disk, for bf16-split and int4-b32 (issue 32).

    python bench/trainers_in_place.py --work /tmp/in-place-bench [--passes 5]

Makes (once, reused): a run of the first 60 ShareGPT rows through SmolLM2 (taps 3,15,27,29, --final
post-norm, <= 1,024 tokens: tap 29 = L-1 is speculators' pre-norm last slot, the post-norm final SpecForge's
target) in bf16-split, its int4-b32 recode, and per codec and trainer the full export and the `--no-states`
one. Then, in one process with one torch thread (numbers are per core), reads every item the way each
trainer's loader does, and touches every memory page of every tensor it gets (a file torch maps lazily is
only read when used): speculators' own `ArrowDataset` (`ds[i]`, what its DataLoader workers call) with
its `file` backend and with the `capture` backend (shards/speculators.py); SpecForge's
`feature_store.load_feature_file` (what its LocalFeatureStore's prefetch threads call) on the exported
files and, shim installed (shards/specforge.py), on the stubs. Warm (one untimed pass first), median of
--passes interleaved passes.
"""

from __future__ import annotations

import argparse
import functools
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
                               "3,15,27,29", "--final", "post-norm", "--max-tokens", "1024", "--overlength", "truncate",
                               "--codec", "bf16-split", "--no-progress", "--out", runs["bf16-split"])
        print(f"- {shown.replace(str(work), '$WORK')}")
    if not runs["int4-b32"].exists():
        recode(runs["bf16-split"], runs["int4-b32"], "int4-b32")
    from specforge.runtime.data_plane import feature_store

    plain_load = feature_store.load_feature_file
    from shards.specforge import install

    install()
    shim_load = feature_store.load_feature_file
    readers, disk = {}, {}
    for codec, run in runs.items():
        made = {}
        for trainer, states in (("speculators", True), ("speculators", False), ("specforge", True), ("specforge", False)):
            folder = work / f"{trainer}-{'files' if states else 'in-place'}-{codec}"
            if not (folder / "export.json").exists():
                export(run, folder, trainer, states=states, layers=[3, 15, 27])
            made[trainer, states] = folder
        files, index = made["speculators", True], made["speculators", False]
        readers[f"{codec}: speculators, file backend (exported)"] = ArrowDataset(max_len=4096, datapath=str(files),
                                                                               on_missing="raise")
        readers[f"{codec}: speculators, capture backend (in place)"] = ArrowDataset(
            max_len=4096, datapath=str(index), transfer=RunTransfer(index), on_missing="raise")
        ckpts = sorted(str(p) for p in made["specforge", True].rglob("*.ckpt"))
        stubs = sorted(str(p) for p in made["specforge", False].rglob("*.ckpt"))
        readers[f"{codec}: specforge, exported .ckpt files"] = [functools.partial(plain_load, p) for p in ckpts]
        readers[f"{codec}: specforge, stubs + shim (in place)"] = [functools.partial(shim_load, p) for p in stubs]
        disk[codec] = {"run shards": du(run), "speculators export": du(files), "index": du(index),
                       "specforge export": du(made["specforge", True]), "stubs": du(made["specforge", False])}

    def touched(load):  # a lazily mapped file (torch.load mmap=True) is read when used: read every page
        def call():
            for v in load().values():
                if isinstance(v, torch.Tensor) and v.numel():
                    v.reshape(-1)[:: max(1, 4096 // v.element_size())].sum()
        return call

    def items(reader):
        loads = ([functools.partial(reader.__getitem__, i) for i in range(len(reader))] if hasattr(reader, "data")
                 else reader)
        return [touched(f) for f in loads]

    calls = {name: items(r) for name, r in readers.items()}
    n = len(next(iter(calls.values())))
    tokens = sum(next(iter(readers.values())).approx_lengths)
    for fns in calls.values():  # warm: page cache, imports, shard maps
        for f in fns:
            f()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.passes):
        for name, fns in calls.items():
            t0 = time.perf_counter()
            for f in fns:
                f()
            times[name].append(time.perf_counter() - t0)
    print(f"\n{n} items, {tokens:,} tokens; one torch thread; median of {args.passes} passes\n")
    print(f"{'reader':<56} {'items/s':>9} {'tokens/s':>11}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:<56} {n / t:>9.1f} {tokens / t:>11,.0f}")
    print(f"\n{'disk (MiB)':<16} " + " ".join(f"{k:>20}" for k in next(iter(disk.values()))))
    for codec, d in disk.items():
        print(f"{codec:<16} " + " ".join(f"{v / 2**20:>20,.1f}" for v in d.values()))
    print("\nin place: what a team keeps is the run (shards) plus the index; exported: the run plus the export")


if __name__ == "__main__":
    main()
