"""Capture feeding a reader: offline (capture, then read), tail (read while the capture writes), tail with
``--retain N`` (bounded disk: the reader acks, the capture deletes what it consumed) and online (rows
over Ray from the replicas to the reader, no shards: :mod:`capture.online`).

Each mode runs the same capture (SmolLM2, ShareGPT rows, 2 Ray replicas on this CPU, small shards so
that several commit, or units of the same size online) and a consumer in this process: a
``ShardStream`` (``tail=True`` in the tail modes) or an ``OnlineStream`` whose samples are packed into
token-budget batches (:func:`shards.pack.pack`), each batch one "step" (no model: the steps measure what
the data path delivers, not a drafter's compute); in the retain and online modes the consumer acks after
every step (a checkpoint per step). The file modes run ``capture run`` as a subprocess; the online mode
runs the capture's driver on a thread of this process (as a trainer does). Sampled every 0.1 s: the run
folder's bytes on disk, the PSS of the capture's process tree (Ray's daemons and replicas included) plus
this process, and (online) Ray's plasma object-store usage.

Reported per mode: wall seconds from the capture's start to the last step, time to the first step,
steps and steps/s over that wall time, the consumer's own steps/s (offline: reading the finished run;
online: without its waits for the queue; tail: not separable), peak object-store MiB (online), shards removed and
seconds the capture waited for acks (retain), peak bytes on disk, peak memory. Writes nothing outside a temporary folder.

    python bench/online.py [--rows 48] [--retain 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil

from harness import CLI, REPO, header, plasma_mib
from shards.pack import pack
from shards.stream import ShardStream


class Sampler(threading.Thread):
    """Peak folder bytes and peak PSS of a process tree plus this process, every ``interval`` s."""

    def __init__(self, folder: Path, pid: int, interval: float = 0.1, plasma: bool = False):
        super().__init__(daemon=True)
        self.folder, self.root, self.interval, self.plasma = folder, psutil.Process(pid), interval, plasma
        self.peak_disk = self.peak_pss = self.peak_plasma_mib = 0
        self.stop = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            if self.plasma:
                self.peak_plasma_mib = max(self.peak_plasma_mib, plasma_mib())
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


SETTINGS = {"dataset": "sharegpt", "layers": "3,15,27", "final": "post-norm", "max_tokens": 512,
            "overlength": "truncate", "replicas": 2, "shard_size": "1MiB", "unit_tokens": 2048,
            "first_unit_tokens": 1024}


def one(mode: str, rows: int, retain: int, work: Path) -> dict:
    out = work / mode
    t0 = time.perf_counter()
    if mode == "online":
        from capture import online
        from capture.config import from_mapping

        cfg = from_mapping({**SETTINGS, "target": "smollm2-135m", "limit": rows, "out": str(out),
                            "progress": False})
        run = online.start(cfg)
        sampler = Sampler(out, os.getpid(), plasma=True)
        sampler.start()
        stream = run.stream(0, poll_s=0.1, timeout_s=600)
    else:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
        cmd = [*CLI, "run", "--out", str(out), "--limit", str(rows), *flags, "--json",
               "--no-progress"] + (["--retain", str(retain)] if mode == "tail+retain" else [])
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "TQDM_DISABLE": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        sampler = Sampler(out, proc.pid)
        sampler.start()
        if mode == "offline":
            stdout, stderr = proc.communicate()
        stream = ShardStream(out, tail=mode != "offline", poll_s=0.1, timeout_s=600)
    first = None
    steps = samples = 0
    c0 = time.perf_counter()
    for batch in pack(iter(stream), 2048):
        steps += 1
        samples += len(batch["sample_ids"])
        first = first or time.perf_counter() - t0
        if mode == "tail+retain":
            stream.ack(stream.state_dict(consumed=samples))  # what the steps consumed (pack reads one ahead)
        elif mode == "online":
            stream.ack(batch["sample_ids"])
    end = time.perf_counter() - t0
    # the consumer's own time (decode, pack, acks): all of it offline (the run is complete), online without
    # its waits for the queue; in tail mode its waits for commits are not separable from decoding
    own = {"offline": time.perf_counter() - c0,
           "online": time.perf_counter() - c0 - getattr(stream, "wait_seconds", 0.0)}.get(mode)
    if mode == "online":
        summary = run.join()
    else:
        if mode != "offline":
            stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"{mode}: capture exited {proc.returncode}:\n{stderr[-3000:]}")
        summary = json.loads(stdout)
    sampler.stop.set()
    sampler.join()
    return {"mode": mode, "wall_s": end, "first_step_s": first, "steps": steps, "samples": samples,
            "steps_per_s": steps / end, "own_steps_per_s": steps / own if own else None,
            "plasma_mib": sampler.peak_plasma_mib, "peak_disk_mib": sampler.peak_disk / 2**20,
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
    header()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("offline", "tail", "tail+retain", "online"):
            results.append(one(mode, args.rows, args.retain, Path(tmp)))
    r0 = results[0]
    print(f"{r0['rows']} ShareGPT rows, {r0['tokens']:,} tokens (SmolLM2, taps 3/15/27 + final, bf16-split), "
          f"2 Ray replicas, {psutil.cpu_count()} CPUs; steps = packed batches of <= 2048 tokens, no model")
    print(f"{'mode':12s} {'wall s':>6s} {'1st step s':>10s} {'steps':>5s} {'steps/s':>7s} {'consumer steps/s':>16s} "
          f"{'shards':>6s} {'removed':>7s} {'capture wait s':>14s} {'peak disk MiB':>13s} "
          f"{'peak plasma MiB':>15s} {'peak PSS MiB':>12s}")
    for r in results:
        own = f"{r['own_steps_per_s']:16.1f}" if r["own_steps_per_s"] else f"{'-':>16s}"
        print(f"{r['mode']:12s} {r['wall_s']:6.1f} {r['first_step_s']:10.1f} {r['steps']:5d} {r['steps_per_s']:7.2f} "
              f"{own} {r['shards']:6d} {r['removed']:7d} {r['capture_wait_s']:14.1f} {r['peak_disk_mib']:13.1f} "
              f"{r['plasma_mib']:15d} {r['peak_pss_mib']:12.0f}")


if __name__ == "__main__":
    main()
