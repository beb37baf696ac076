"""1 vs 2 engine replicas on this 2-core CPU: the same 60 ShareGPT conversations (cut at 1,024 tokens),
SmolLM2, taps 3/15/27, HF engine.

    python bench/replicas.py

1 replica gets both cores (torch intra-op threads = 2); 2 replicas get one core each. Wall time includes
Ray start-up and engine load; "engine tokens/s" divides by the busiest replica's time inside units.
"""

from __future__ import annotations

from pathlib import Path

from harness import capture_run, header, workdir


def run(out: Path, replicas: int) -> dict:
    return capture_run("--dataset", "sharegpt", "--layers", "3,15,27", "--limit", "60", "--max-tokens", "1024",
                       "--overlength", "truncate", "--unit-tokens", "4096", "--out", str(out), "--replicas",
                       str(replicas), "--cpus-per-replica", str(2 // replicas), "--no-progress", "--json")[0]


def main() -> None:
    header()  # with the load average before
    tmp = workdir("replicas-bench-")
    print("| replicas | cores each | rows | tokens | wall s | tokens/s (wall) | busiest replica s | "
          "engine tokens/s | units per replica |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for n in (1, 2):
        s = run(tmp / f"r{n}", n)
        busy = max(r["busy_seconds"] for r in s["replicas"])
        print(f"| {n} | {2 // n} | {s['committed_rows']} | {s['committed_tokens']:,} | {s['seconds']:.1f} | "
              f"{s['committed_tokens'] / s['seconds']:,.0f} | {busy:.1f} | {s['committed_tokens'] / busy:,.0f} | "
              f"{', '.join(str(r['units']) for r in s['replicas'])} |")


if __name__ == "__main__":
    main()
