"""Peak resident memory of `capture drafter train` on a run and on one 8x larger (same settings), before and
after the trainer streams (issue 31).

Runs: tests/helpers.drafter_run, random bf16 states in the real shard format, 1,024 tokens a conversation,
2 taps of 576 channels (SmolLM2's hidden size: 2.25 MiB of states a conversation), 40 and 320
conversations. Each training runs in a fresh process with no DataLoader worker (every decode in that
process) and reports its own ``ru_maxrss``; "before" is the trainer of commit BEFORE (default 17bd1ec, the
list-loading trainer) run from a git worktree, "after" this checkout's.

    python bench/trainer_memory.py [--before 17bd1ec] [--small 40] [--ratio 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import REPO, header

sys.path.insert(0, str(REPO / "tests"))
import helpers  # noqa: E402

PEAK = """
import resource, sys
from cli import main
import sys as _s, drafter.train  # noqa
print("trainer_file", _s.modules["drafter.train"].__file__, file=sys.stderr)
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    print("peak_rss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def peak_mib(code_dir: Path, run: Path, target: Path, out: Path, streaming: bool) -> float:
    args = ["drafter", "train", "--run", str(run), "--target-dir", str(target), "--out", str(out), "--steps", "20",
            "--anchors-per-step", "256", "--anchors-per-seq", "32", "--d-model", "64", "--eval-anchors", "1024",
            "--no-progress", *(["--workers", "0"] if streaming else [])]
    proc = subprocess.run([sys.executable, "-c", PEAK, *args], cwd=code_dir, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(code_dir), "TQDM_DISABLE": "1"})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    loaded = proc.stderr.split("trainer_file")[-1].split()[0]
    assert loaded.startswith(str(code_dir)), f"{loaded} is not {code_dir}'s trainer"
    return int(proc.stderr.split("peak_rss_kib")[-1].split()[0]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="17bd1ec")
    ap.add_argument("--small", type=int, default=40)
    ap.add_argument("--ratio", type=int, default=8)
    args = ap.parse_args()
    header()
    with tempfile.TemporaryDirectory(prefix="trainer-memory-") as tmp:
        tmp = Path(tmp)
        old = tmp / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.before], cwd=REPO, check=True,
                       capture_output=True)
        try:
            sizes = (args.small, args.small * args.ratio)
            runs = {n: helpers.drafter_run(tmp / f"n{n}", n, tokens=1024, hidden=576, vocab=8192) for n in sizes}
            print(f"runs: {sizes[0]} and {sizes[1]} conversations of 1,024 tokens, 2 taps x 576 bf16 channels "
                  f"(2.25 MiB of states a conversation)")
            print(f"{'trainer':<28} {sizes[0]:>6} conv. MiB {sizes[1]:>6} conv. MiB  ratio")
            for name, code, streaming in ((f"before ({args.before}, lists)", old, False), ("after (streaming)", REPO, True)):
                peaks = [peak_mib(code, *runs[n], tmp / f"out-{name[:5]}-{n}", streaming) for n in sizes]
                print(f"{name:<28} {peaks[0]:>16,.0f} {peaks[1]:>16,.0f}  {peaks[1] / peaks[0]:.2f}x", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True)


if __name__ == "__main__":
    main()
