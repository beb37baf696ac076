"""Recorded self-distillation run: greedy `last`-turn regeneration of real ShareGPT prompts with both
engines, then every stored row checked against a reference prefill of its stored ids.

For each engine it runs the real CLI (`capture run --responses regenerate ...`), reads the shards back,
and prefills each stored row alone with HF, in bf16 (what a record prefilled alone gets: the HF engine's
own reference) and in float32 (the rounding-free reference): the stored states are compared with both
(per-token cosine, every column) and the stored ids must be prompt + generated answer with the loss mask
on exactly the answer. Prints a table per engine and how often the two engines' greedy answers agree.

    .venv/bin/python bench/regenerate_check.py --limit 64 > bench/regenerate_check.out
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

REPO = Path(__file__).resolve().parents[1]
LAYERS = "3,15,27"


def run(engine: str, out: Path, limit: int, max_new: int) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "cli", "run", "--engine", engine, "--dataset", "sharegpt", "--limit", str(limit),
           "--layers", LAYERS, "--final", "post-norm", "--responses", "regenerate", "--regenerate-policy", "last",
           "--max-new-tokens", str(max_new), "--out", str(out), "--json", "--no-progress"]
    if engine == "vllm":
        cmd += ["--max-model-len", "4096"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), " ".join(["capture", *cmd[3:]])


def check(out: Path, refs: dict) -> dict:
    from shards.reader import read_table, shard_paths, state_tensor

    table = pa.concat_tables([read_table(p) for p in shard_paths(out)])
    cos = collections.defaultdict(list)
    answers, reasons = {}, collections.Counter()
    for i in range(table.num_rows):
        ids = np.asarray(table.column("input_ids")[i].as_py(), dtype=np.int32)
        mask = np.asarray(table.column("loss_mask")[i].as_py(), dtype=bool)
        start = int(np.argmax(mask))
        assert mask[start:].all() and not mask[:start].any(), "loss mask is not exactly the answer"
        answers[table.column("sample_id")[i].as_py()] = tuple(ids[start:])
        reasons.update(table.column("finish_reasons")[i].as_py())
        for name, ref in refs.items():
            for col, w in ref.forward([ids])[0].states.items():
                got = state_tensor(table, col, i).float()
                cos[name, col].append(torch.nn.functional.cosine_similarity(got, w.float(), dim=-1))
    stats = {key: (torch.cat(c).mean().item(), torch.cat(c).min().item()) for key, c in cos.items()}
    return {"rows": table.num_rows, "tokens": int(sum(table.column("num_tokens").to_pylist())),
            "generated": int(sum(len(a) for a in answers.values())), "reasons": dict(reasons), "cos": stats,
            "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=64, help="ShareGPT rows read")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from capture.engines.hf import HFEngine
    from capture.targets import PRESETS, make_taps, model_dir

    taps = make_taps(PRESETS["smollm2-135m"], tuple(map(int, LAYERS.split(","))), "post-norm")
    mdir = str(model_dir(PRESETS["smollm2-135m"]))
    refs = {dtype: HFEngine(mdir, taps, argmax=False, dtype=dtype) for dtype in ("bfloat16", "float32")}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("hf", "vllm"):
            summary, cmd = run(engine, Path(tmp) / engine, args.limit, args.max_new_tokens)
            res = check(Path(tmp) / engine, refs)
            results[engine] = res
            print(f"$ {cmd}")
            print(f"{engine}: {res['rows']} rows stored ({summary['rows_read']} read, skipped {summary['skipped']}, "
                  f"rejected {summary['rejected']}), {res['tokens']:,} tokens, {res['generated']:,} generated, "
                  f"finish reasons {res['reasons']}, {summary['seconds']} s end to end "
                  f"(incl. engine load) = {res['tokens'] / summary['seconds']:.0f} tok/s")
            print("  stored states vs an HF prefill of the stored ids alone (per-token cosine, mean / min):")
            print(f"    {'column':8} {'bf16 reference':>21} {'float32 reference':>21}")
            for col in sorted({c for _, c in res["cos"]}):
                b, f = res["cos"]["bfloat16", col], res["cos"]["float32", col]
                print(f"    {col:8} {b[0]:.6f} / {b[1]:.6f}   {f[0]:.6f} / {f[1]:.6f}")
    a, b = results["hf"]["answers"], results["vllm"]["answers"]
    both = sorted(set(a) & set(b))
    same = sum(a[k] == b[k] for k in both)
    prefix = [next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), min(len(a[k]), len(b[k]))) for k in both]
    print(f"greedy answers identical in both engines: {same}/{len(both)}; "
          f"median common prefix {int(np.median(prefix))} tokens")


if __name__ == "__main__":
    main()
