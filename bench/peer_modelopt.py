"""capture against NVIDIA Model-Optimizer's HF hidden-state dumper, side by side on the same rows.

The peer is ``examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py`` from
https://github.com/NVIDIA/Model-Optimizer, run from your own checkout of it (nothing of it is copied or
fetched here; without ``--peer`` this script says so and exits 0). Both get the same ShareGPT
conversations (written once as a ``conversations: [{role, content}]`` JSONL, each <= --max-tokens under
SmolLM2's chat template), the same SmolLM2 bf16 folder, taps 3/15/27 and the post-norm final state:

  peer    : ``python compute_hidden_states_hf.py --model DIR --input-data rows.jsonl --output-dir OUT
            --aux-layers 3,15,27`` (one conversation per forward, ``output_hidden_states`` of every layer,
            a ``torch.save`` file per conversation, raw bf16)
  capture : ``capture run --target smollm2-135m --model-path DIR --dataset rows.jsonl --layers 3,15,27
            --final post-norm --no-argmax --dtype bfloat16`` (shards + manifest), twice: with its default
            executor (one replica in the driver's process) and with ``--executor ray`` (a Ray actor)

Each command runs as its own process tree, sampled every 0.2 s with psutil: CPU seconds (user + system)
of every process in the tree, Ray's daemons and workers included (``/usr/bin/time`` sees only waited
children), and the tree's summed PSS at each sample (its peak is reported). Tokens per CPU-second =
tokens captured / the tree's CPU seconds, start-up included. Runs are interleaved (peer, capture,
capture on Ray, peer, ...) and the median of --repeats is reported, with bytes on disk per token and how the two runs'
states agree (per-token cosine and the share of tokens bit-identical, tap by tap; input ids compared
first).

    python bench/peer_modelopt.py --peer PATH/compute_hidden_states_hf.py [--rows 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from harness import encoded, header, smollm2, workdir

LAYERS = (3, 15, 27)


def run_tree(cmd: list[str], env: dict, interval: float = 0.2) -> dict:
    """Run ``cmd``; its tree's wall seconds, CPU seconds (every process seen, by (pid, start time)),
    peak summed PSS (bytes), each process's PSS at that peak (``at_peak``: [(name, bytes)], Ray's process
    titles such as ``ray::Replica``) and the most processes alive at once. Raises CalledProcessError."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    cpu: dict[tuple[int, float], float] = {}
    peak_pss = most = 0
    at_peak: list[tuple[str, int]] = []
    start = time.perf_counter()
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        sample = []
        for p in tree:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cpu[(p.pid, p.create_time())] = t.user + t.system
                    sample.append((process_name(p), p.memory_full_info().pss))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        pss = sum(b for _, b in sample)
        if pss > peak_pss:
            peak_pss, at_peak = pss, sorted(sample, key=lambda x: -x[1])
        most = max(most, len(tree))
        time.sleep(interval)
    wall = time.perf_counter() - start
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out)
    return {"wall": wall, "cpu": sum(cpu.values()), "pss": peak_pss, "at_peak": at_peak, "procs": most, "log": out}


def process_name(p: psutil.Process) -> str:
    """A short name: Ray's process title (``ray::Replica``, ``ray::IDLE``) or the program's file name, with
    the script or module a Python interpreter runs."""
    args = [a.rsplit("/", 1)[-1] for a in p.cmdline()] or [p.name()]
    if args[0].startswith("python"):
        rest = [a for a in args[1:] if a == "-m" or not a.startswith("-")]
        return " ".join(rest[:2] if rest[:1] == ["-m"] else rest[:1]) or args[0]
    return args[0].split(" ")[0]


def write_rows(path: Path, mdir: str, rows: int, max_tokens: int) -> int:
    """The first ``rows`` ShareGPT conversations of at most ``max_tokens`` tokens, as JSONL; their tokens."""
    kept, tokens = [], 0
    for conv, rec in itertools.islice(encoded(mdir), 20 * rows):
        if isinstance(rec, str) or not 10 < rec.num_tokens <= max_tokens:
            continue
        kept.append({"conversation_id": len(kept), "conversations": [{"role": r, "content": c} for r, c in conv.messages]})
        tokens += rec.num_tokens
        if len(kept) == rows:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return tokens


def compare(peer_dir: Path, run: Path) -> dict:
    """Input ids and states of the two outputs, matched by row (conversation_id = capture's row_index)."""
    from shards.reader import iter_rows

    cos = {k: [] for k in (*LAYERS, "final")}
    same = {k: [] for k in cos}
    ids_equal = rows = 0
    for row in iter_rows(run):
        peer = torch.load(peer_dir / f"{row['row_index']}.pt")
        rows += 1
        if not np.array_equal(peer["input_ids"].numpy(), row["input_ids"]):
            continue
        ids_equal += 1
        aux = peer["aux_hidden_states"].split(576, dim=-1)
        pairs = [(k, row[f"tap_{k}"], aux[i]) for i, k in enumerate(LAYERS)] + [("final", row["final"], peer["hidden_states"])]
        for k, ours, theirs in pairs:
            cos[k].append(torch.nn.functional.cosine_similarity(ours.float(), theirs.float(), dim=-1))
            same[k].append((ours == theirs).all(dim=-1))
    out = {"rows": rows, "input_ids_equal": ids_equal}
    for k in cos:
        if cos[k]:
            c, s = torch.cat(cos[k]), torch.cat(same[k]).float()
            out[str(k)] = (float(c.min()), float(c.mean()), float(s.mean()))
    return out


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", type=Path, help="path to Model-Optimizer's compute_hidden_states_hf.py")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    if args.peer is None or not args.peer.is_file():
        print(f"skipped: no peer script ({args.peer or 'pass --peer PATH/compute_hidden_states_hf.py'}); "
              "clone https://github.com/NVIDIA/Model-Optimizer and point --peer at "
              "examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py")
        return
    header()

    mdir = str(smollm2())
    work = workdir("peer-bench-", args.work)
    data = work / "rows.jsonl"
    tokens = write_rows(data, mdir, args.rows, args.max_tokens)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    layers = ",".join(map(str, LAYERS))
    capture_bin = str(Path(sys.executable).with_name("capture"))

    def peer(out: Path) -> list[str]:
        return [sys.executable, str(args.peer), "--model", mdir, "--input-data", str(data), "--output-dir", str(out),
                "--aux-layers", layers, "--max-seq-len", str(args.max_tokens)]

    def ours(out: Path, *extra: str) -> list[str]:
        return [capture_bin, "run", "--target", "smollm2-135m", "--model-path", mdir, "--dataset", str(data),
                "--layers", layers, "--final", "post-norm", "--no-argmax", "--dtype", "bfloat16",
                "--max-tokens", str(args.max_tokens), "--no-progress", "--out", str(out), *extra]

    contenders = (("Model-Optimizer", peer), ("capture", ours), ("capture on Ray", lambda out: ours(out, "--executor", "ray")))
    results: dict[str, list[dict]] = {name: [] for name, _ in contenders}
    for rep in range(args.repeats):
        for name, make in contenders:
            out = work / f"{name}-{rep}"
            r = run_tree(make(out), env)
            r["bytes"] = disk_bytes(out)
            r["out"] = out
            results[name].append(r)
            print(f"# {name} run {rep}: {r['wall']:.1f} s wall, {r['cpu']:.1f} CPU-s, peak PSS "
                  f"{r['pss'] / 2**20:,.0f} MiB, {r['procs']} processes", flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(f"\n{args.rows} ShareGPT conversations, {tokens:,} tokens (<= {args.max_tokens} each), SmolLM2-135M bf16, "
          f"taps {layers} + post-norm final, {psutil.cpu_count()} CPUs; median of {args.repeats} interleaved runs\n")
    print("| | capture | capture on Ray | Model-Optimizer | capture / peer | on Ray / peer |")
    print("|---|---|---|---|---|---|")
    rows = [("tokens/s (wall, start-up included)", lambda n: tokens / med(n, "wall"), "{:,.1f}"),
            ("tokens per CPU-second, whole process tree", lambda n: tokens / med(n, "cpu"), "{:,.1f}"),
            ("bytes on disk per token", lambda n: med(n, "bytes") / tokens, "{:,.0f}"),
            ("peak memory, whole process tree (PSS, MiB)", lambda n: med(n, "pss") / 2**20, "{:,.0f}"),
            ("processes at most", lambda n: med(n, "procs"), "{:.0f}")]
    for label, f, fmt in rows:
        a, r, b = f("capture"), f("capture on Ray"), f("Model-Optimizer")
        print(f"| {label} | {fmt.format(a)} | {fmt.format(r)} | {fmt.format(b)} | {a / b:.2f}x | {r / b:.2f}x |")
    for name, _ in contenders:
        r = results[name][-1]
        print(f"\n{name}, PSS of each process at its tree's peak (last run): "
              + ", ".join(f"{n} {b / 2**20:,.0f} MiB" for n, b in r["at_peak"]))
    agree = compare(results["Model-Optimizer"][0]["out"], results["capture"][0]["out"])
    print(f"\nstates, capture vs Model-Optimizer: {agree['input_ids_equal']} of {agree['rows']} rows with equal input ids")
    for k in (*LAYERS, "final"):
        if str(k) in agree:
            lo, mean, same = agree[str(k)]
            print(f"- {'tap ' + str(k) if k != 'final' else 'final'}: per-token cosine min {lo:.6f}, mean {mean:.6f}; "
                  f"tokens bit-identical {same:.1%}")


if __name__ == "__main__":
    main()
