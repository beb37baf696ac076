"""`capture audit` throughput and memory on a reference of every parseable ShareGPT row plus the
Open-PerfectBlend sample (~17.7k rows), extrapolated to Open-PerfectBlend's 1.42M rows.

    python bench/audit.py [RUN_DIR]        # default: capture 60 ShareGPT rows first (SmolLM2, tap 3)

The reference is written as one JSON Lines file (the ShareGPT rows as parsed, then the sample). The audit
runs as the real CLI in a fresh Python that reports its own peak RSS (getrusage); the index size comes
from the report.
A second child loads only the tokenizer and imports, to separate the fixed cost from the index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO, capture_run, header, workdir

SAMPLE = REPO.parent / "shared" / "data" / "open-perfectblend-sample.jsonl"
OPEN_PERFECTBLEND_ROWS = 1_420_000


def reference(path: Path) -> int:
    """Write every parseable ShareGPT record, then the sample, as JSON lines; returns the row count."""
    import ijson

    from capture.dataset import resolve_dataset

    rows = 0
    with open(path, "w") as out, open(resolve_dataset("sharegpt").path, "rb") as f:
        try:
            for item in ijson.items(f, "item"):
                out.write(json.dumps(item, default=float) + "\n")
                rows += 1
        except ijson.JSONError:
            pass  # the file ends mid-record
        for line in open(SAMPLE):
            out.write(line)
            rows += 1
    return rows


def child(code: str) -> tuple[float, int, subprocess.CompletedProcess]:
    """Run ``code`` in a fresh Python; wall seconds and that process's own peak RSS in bytes (it prints
    its ``ru_maxrss``, KiB on Linux, as the last line of stderr)."""
    wrapped = ("import resource, sys\ntry:\n" + "".join(f"    {line}\n" for line in code.splitlines())
               + "finally:\n    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    seconds = time.perf_counter() - t
    return seconds, int(proc.stderr.strip().splitlines()[-1]) * 1024, proc


def main() -> None:
    header()
    tmp = workdir("audit-bench-")
    run_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else tmp / "run"
    if len(sys.argv) <= 1:
        capture_run("--dataset", "sharegpt", "--layers", "3", "--limit", "60", "--out", run_dir, "--no-progress")
    ref = tmp / "reference.jsonl"
    rows = reference(ref)
    print(f"reference: {rows:,} rows ({ref.stat().st_size / 2**20:,.0f} MiB JSON lines); run: {run_dir}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    model = json.loads((run_dir / "provenance.json").read_text())["model_dir"]
    _, base_rss, _ = child(f"import provenance.audit, transformers\ntransformers.AutoTokenizer.from_pretrained({model!r})")
    small = tmp / "reference-2000.jsonl"
    with open(ref) as src, open(small, "w") as dst:
        dst.writelines(line for _, line in zip(range(2000), src))
    print("| reference rows | tokens | wall s (incl. start-up) | rows/s | tokens/s | index keys (whole / prefix) "
          "| index peak MiB | index B/row | peak RSS MiB | RSS above imports+tokenizer MiB |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for path, n in ((small, 2000), (ref, rows)):
        argv = ["capture", "audit", str(run_dir), "--reference", str(path), "--json", "--no-progress"]
        seconds, rss, proc = child(f"import runpy\nsys.argv = {argv!r}\nrunpy.run_module('cli', run_name='__main__')")
        if proc.returncode not in (0, 1):
            sys.exit(f"audit failed ({proc.returncode}): {proc.stderr[-2000:]}")
        r = json.loads(proc.stdout)
        idx, tokens = r["index"], r["reference"]["tokens"]
        print(f"| {n:,} | {tokens:,} | {seconds:,.1f} | {n / seconds:,.0f} | {tokens / seconds:,.0f} | "
              f"{idx['whole_keys']:,} / {idx['prefix_keys']:,} | {idx['peak_bytes'] / 2**20:,.1f} | "
              f"{idx['peak_bytes'] / n:,.0f} | {rss / 2**20:,.0f} | {(rss - base_rss) / 2**20:,.0f} |")
    cats = ", ".join(f"{c} {v['rows']}" for c, v in r["categories"].items() if v["rows"])
    per_row = idx["peak_bytes"] / rows
    print()
    print(f"full reference: {r['captured']['rows']} captured rows ({cats}); {r['reference']['tokenized']:,} rows "
          f"tokenized (longest {r['reference']['longest_tokens']:,} tokens); skipped {r['reference']['skipped']}; "
          f"imports + tokenizer alone: {base_rss / 2**20:,.0f} MiB")
    probe = (f"from capture.chat import load_encoder\nfrom capture.dataset import resolve_dataset\n"
             f"from provenance import reference\nenc = load_encoder({model!r})\nn = [0]\n"
             "def tick():\n    n[0] += 1\n    if n[0] % 2000 == 0:\n"
             "        print(n[0], int(open('/proc/self/statm').read().split()[1]) * 4096 // 2**20)\n"
             f"reference.build(resolve_dataset({str(ref)!r}), enc, on_row=tick)")
    _, probe_rss, proc = child(probe)
    samples = [line.split() for line in proc.stdout.splitlines()]
    print("current RSS (MiB) while indexing the full reference, every 2,000 rows: "
          + ", ".join(f"{int(a):,}: {b}" for a, b in samples) + f"; peak {probe_rss / 2**20:,.0f} MiB")
    print("so peak RSS = imports + tokenizer + the longest row's tokenization + the index, not a per-row growth")
    print(f"extrapolated to Open-PerfectBlend's {OPEN_PERFECTBLEND_ROWS:,} rows: index {per_row:,.0f} B/row x rows = "
          f"{per_row * OPEN_PERFECTBLEND_ROWS / 2**20:,.0f} MiB (+ imports, tokenizer and the longest row's tokenization); "
          f"{OPEN_PERFECTBLEND_ROWS / (rows / seconds) / 3600:,.1f} h at this throughput (one process)")


if __name__ == "__main__":
    main()
