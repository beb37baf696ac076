"""Recorded self-distillation run: greedy `last`-turn regeneration of real ShareGPT prompts with both
engines, then every stored row checked against a reference prefill of its stored ids.

For each engine it runs the real CLI (`capture run --responses regenerate ...`), reads the shards back,
and prefills each stored row alone with HF in float32 (the reference): the stored states must match it
(per-token cosine, every column) and the stored ids must be prompt + generated answer with the loss mask
on exactly the answer. Prints a table per engine and how often the two engines' greedy answers agree.

    .venv/bin/python bench/regenerate_check.py --limit 64 > bench/regenerate_check.out
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from harness import capture_run, header, smollm2, smollm2_taps

LAYERS = "3,15,27"


def run(engine: str, out: Path, limit: int, max_new: int) -> tuple[dict, str]:
    args = ["--engine", engine, "--dataset", "sharegpt", "--limit", str(limit), "--layers", LAYERS, "--final",
            "post-norm", "--responses", "regenerate", "--regenerate-policy", "last", "--max-new-tokens", str(max_new),
            "--out", str(out), "--json", "--no-progress"]
    if engine == "vllm":
        args += ["--max-model-len", "4096"]
    return capture_run(*args)


def check(out: Path, ref) -> dict:
    from shards.reader import read_table, shard_paths
    from shards.rows import state_tensor

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
        want = ref.forward([ids])[0].states
        for col, w in want.items():
            cos[col].append(torch.nn.functional.cosine_similarity(state_tensor(table, col, i).float(), w, dim=-1))
    stats = {col: (torch.cat(c).mean().item(), torch.cat(c).min().item()) for col, c in cos.items()}
    return {"rows": table.num_rows, "tokens": int(sum(table.column("num_tokens").to_pylist())),
            "generated": int(sum(len(a) for a in answers.values())), "reasons": dict(reasons), "cos": stats,
            "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=64, help="ShareGPT rows read")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    header()
    from capture.engines.hf import HFEngine

    ref = HFEngine(str(smollm2()), smollm2_taps(tuple(map(int, LAYERS.split(","))), "post-norm"), argmax=False,
                   dtype="float32")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("hf", "vllm"):
            summary, cmd = run(engine, Path(tmp) / engine, args.limit, args.max_new_tokens)
            res = check(Path(tmp) / engine, ref)
            results[engine] = res
            print(f"$ {cmd}")
            print(f"{engine}: {res['rows']} rows stored ({summary['rows_read']} read, skipped {summary['skipped']}, "
                  f"rejected {summary['rejected']}), {res['tokens']:,} tokens, {res['generated']:,} generated, "
                  f"finish reasons {res['reasons']}, {summary['seconds']} s end to end "
                  f"(incl. engine load) = {res['tokens'] / summary['seconds']:.0f} tok/s")
            print(f"  stored states vs float32 HF prefill of the stored ids (per-token cosine, mean / min):")
            for col, (mean, low) in res["cos"].items():
                print(f"    {col:8} {mean:.6f} / {low:.6f}")
    a, b = results["hf"]["answers"], results["vllm"]["answers"]
    both = sorted(set(a) & set(b))
    same = sum(a[k] == b[k] for k in both)
    prefix = [next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), min(len(a[k]), len(b[k]))) for k in both]
    print(f"greedy answers identical in both engines: {same}/{len(both)}; "
          f"median common prefix {int(np.median(prefix))} tokens")


if __name__ == "__main__":
    main()
