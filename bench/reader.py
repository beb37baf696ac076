"""Reader throughput: ShardStream over a run's shards vs the same samples as per-sample torch.save and
safetensors files.

    python bench/reader.py [RUN_DIR] [--passes 3]   # RUN_DIR default /tmp/reader-bench-run

Make the run first (about 3 minutes on 2 cores)::

    capture run --target smollm2-135m --dataset sharegpt --layers 3,15,27 --final post-norm \\
        --out /tmp/reader-bench-run --limit 60 --no-progress

One process, one thread (``torch.set_num_threads(1)``): numbers are per core. Both readers produce the
same sample dicts (int64 ids, bool mask, int64 argmax, bf16 taps [T, L, H] and final [T, H]); the
per-sample files are written first (``torch.save`` of those dicts, what SpecForge-style pipelines store;
``safetensors.torch.save_file`` of the tensors, what speculators' generator stores) and all are read from
the page cache (warm: every pass reads everything once before timing). "GB/s
decompressed" counts the bf16 state bytes delivered (T * (L+1) * H * 2) per second. Median of
``--passes`` interleaved passes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from harness import header
from shards.manifest import read as read_manifest
from shards.stream import ShardStream


def state_bytes(sample: dict) -> int:
    return sum(sample[k].numel() * sample[k].element_size() for k in ("taps", "final") if k in sample)


def timed(samples) -> tuple[float, int, int, int]:
    start = time.perf_counter()
    n = tokens = nbytes = 0
    for s in samples:
        n += 1
        tokens += len(s["input_ids"])
        nbytes += state_bytes(s)
    return time.perf_counter() - start, n, tokens, nbytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", nargs="?", default="/tmp/reader-bench-run")
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    header()
    torch.set_num_threads(1)
    run = Path(args.run)
    shard_bytes = sum(s["bytes"] for s in read_manifest(run).shards)

    with tempfile.TemporaryDirectory(prefix="reader-bench-") as tmp:
        files, st_files = [], []
        start = time.perf_counter()
        for i, sample in enumerate(ShardStream(run)):
            path = Path(tmp) / f"data_{i}.pt"
            torch.save(sample, path)
            files.append(path)
            st_files.append(Path(tmp) / f"hs_{i}.safetensors")
            save_file({k: v.contiguous() for k, v in sample.items() if torch.is_tensor(v)}, st_files[-1])
        write_s = time.perf_counter() - start
        file_bytes = sum(p.stat().st_size for p in files)

        readers = {
            "ShardStream, in process": lambda: ShardStream(run),
            "ShardStream, DataLoader 1 worker": lambda: DataLoader(ShardStream(run), batch_size=None, num_workers=1),
            "ShardStream, shuffled (buffer 1024)": lambda: ShardStream(run, shuffle=True, seed=0),
            "torch.load per-sample files": lambda: (torch.load(p, weights_only=True) for p in files),
            "torch.load per-sample files, mmap+clone": lambda: (
                {k: v.clone() if torch.is_tensor(v) else v for k, v in torch.load(p, weights_only=True, mmap=True).items()}
                for p in files),
            # load_file maps the file: clone, or nothing is read (a row of ~47 GB/s that only opened files)
            "safetensors load_file per-sample files": lambda: (
                {k: v.clone() for k, v in load_file(p).items()} for p in st_files),
        }
        for make in readers.values():  # warm the page cache and imports
            timed(make())
        results = {name: [] for name in readers}
        for _ in range(args.passes):
            for name, make in readers.items():
                results[name].append(timed(make()))

    print(f"codec {read_manifest(run).header.codec}, format {read_manifest(run).header.format_version}")
    print(f"run {run}: {results[next(iter(readers))][0][1]} samples, {results[next(iter(readers))][0][2]:,} tokens; "
          f"shards {shard_bytes / 2**20:,.1f} MiB, per-sample torch.save files {file_bytes / 2**20:,.1f} MiB "
          f"(written in {write_s:.1f} s); 1 thread, median of {args.passes} passes, warm page cache")
    print(f"{'reader':40s} {'s':>7s} {'tokens/s':>10s} {'GB/s decompressed':>18s}")
    for name, runs in results.items():
        secs = statistics.median(r[0] for r in runs)
        _, n, tokens, nbytes = runs[0]
        print(f"{name:40s} {secs:7.3f} {tokens / secs:10,.0f} {nbytes / secs / 1e9:18.2f}")


if __name__ == "__main__":
    main()
