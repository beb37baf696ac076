"""Capture feeding a reader: offline (capture, then read), tail (read while the capture writes) and tail with
``--retain N`` (bounded disk: the reader acks, the capture deletes what it consumed).

Each mode runs the same ``capture run`` (SmolLM2, ShareGPT rows, 2 Ray replicas on this CPU, small shards
so that several commit) as a subprocess, and a consumer in this process: a ``ShardStream`` (``tail=True``
in the tail modes) whose samples are packed into token-budget batches (:func:`shards.pack.pack`), each
batch one "step" (no model: the steps measure what the data path delivers, not a drafter's compute); in
the retain mode the consumer acks after every step (a checkpoint per step). Sampled every 0.1 s: the run
folder's bytes on disk and the PSS of the capture's process tree (Ray's daemons and replicas included)
plus this process.

Reported per mode: wall seconds from the capture's start to the last step, time to the first step,
steps and steps/s over that wall time, seconds the consumer spent waiting for data, shards removed and
seconds the capture waited for acks (retain), peak bytes on disk, peak memory. Writes nothing outside a temporary folder.

    python bench/online.py [--rows 48] [--retain 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shards.pack import pack  # noqa: E402
from shards.stream import ShardStream  # noqa: E402


class Sampler(threading.Thread):
    """Peak folder bytes and peak PSS of a process tree plus this process, every ``interval`` s."""

    def __init__(self, folder: Path, pid: int, interval: float = 0.1):
        super().__init__(daemon=True)
        self.folder, self.root, self.interval = folder, psutil.Process(pid), interval
        self.peak_disk = self.peak_pss = 0
        self.stop = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            disk = sum(f.stat().st_size for f in self.folder.glob("*") if f.is_file()) if self.folder.exists() else 0
            self.peak_disk = max(self.peak_disk, disk)
            pss = 0
            try:
                procs = [me, self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                procs = [me]
            for p in procs:
                try:
                    pss += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
                    pass
            self.peak_pss = max(self.peak_pss, pss)
            self.stop.wait(self.interval)


def one(mode: str, rows: int, retain: int, work: Path) -> dict:
    out = work / mode
    cmd = [sys.executable, "-m", "cli", "run", "--out", str(out), "--dataset", "sharegpt", "--layers", "3,15,27",
           "--final", "post-norm", "--limit", str(rows), "--max-tokens", "512", "--overlength", "truncate",
           "--replicas", "2", "--shard-size", "1MiB", "--unit-tokens", "2048", "--first-unit-tokens", "1024",
           "--json", "--no-progress"] + (["--retain", str(retain)] if mode == "tail+retain" else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "TQDM_DISABLE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    sampler = Sampler(out, proc.pid)
    sampler.start()
    if mode == "offline":
        stdout, stderr = proc.communicate()
    stream = ShardStream(out, tail=mode != "offline", poll_s=0.1, timeout_s=600)
    first = None
    steps = samples = 0
    waiting = 0.0
    it = pack(iter(stream), 2048)
    while True:
        w0 = time.perf_counter()
        batch = next(it, None)
        waiting += time.perf_counter() - w0
        if batch is None:
            break
        steps += 1
        samples += len(batch["sample_ids"])
        first = first or time.perf_counter() - t0
        if mode == "tail+retain":
            stream.ack(stream.state_dict(consumed=samples))  # what the steps consumed (pack reads one ahead)
    end = time.perf_counter() - t0
    if mode != "offline":
        stdout, stderr = proc.communicate()
    sampler.stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: capture exited {proc.returncode}:\n{stderr[-3000:]}")
    summary = json.loads(stdout)
    return {"mode": mode, "wall_s": end, "first_step_s": first, "steps": steps, "samples": samples,
            "steps_per_s": steps / end, "wait_s": waiting, "peak_disk_mib": sampler.peak_disk / 2**20,
            "peak_pss_mib": sampler.peak_pss / 2**20, "rows": summary["total_rows"],
            "tokens": summary["total_tokens"],
            "removed": (summary.get("retained") or {}).get("removed_shards", 0),
            "capture_wait_s": (summary.get("retained") or {}).get("wait_seconds", 0.0),
            "shards": summary["shards"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--retain", type=int, default=2)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("offline", "tail", "tail+retain"):
            results.append(one(mode, args.rows, args.retain, Path(tmp)))
    r0 = results[0]
    print(f"{r0['rows']} ShareGPT rows, {r0['tokens']:,} tokens (SmolLM2, taps 3/15/27 + final, bf16-split), "
          f"2 Ray replicas, {psutil.cpu_count()} CPUs; steps = packed batches of <= 2048 tokens, no model")
    print(f"{'mode':14s} {'wall s':>7s} {'1st step s':>10s} {'steps':>6s} {'steps/s':>8s} {'wait s':>7s} "
          f"{'shards':>6s} {'removed':>7s} {'capture wait s':>14s} {'peak disk MiB':>13s} {'peak PSS MiB':>12s}")
    for r in results:
        print(f"{r['mode']:14s} {r['wall_s']:7.1f} {r['first_step_s']:10.1f} {r['steps']:6d} {r['steps_per_s']:8.2f} "
              f"{r['wait_s']:7.1f} {r['shards']:6d} {r['removed']:7d} {r['capture_wait_s']:14.1f} {r['peak_disk_mib']:13.1f} {r['peak_pss_mib']:12.0f}")


if __name__ == "__main__":
    main()
