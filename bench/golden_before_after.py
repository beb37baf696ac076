"""Issue 30's before/after check on this machine: the golden capture (tests/test_golden.py's ARGS: 3 SmolLM2
rows, taps 3/15, post-norm final, top-4, float32 arithmetic) made by the code of each given commit and by the
working tree, decoded by today's reader; prints whether every decoded field (ids, mask, argmax, top-K ids and
log-probabilities, every state cell's bf16 bits) is identical. Each commit is checked out with
``git worktree`` into a temporary folder and run with this virtual environment.

    python bench/golden_before_after.py e5ec26d 8cea61d
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from harness import CLI, REPO, header, torch_cpu

sys.path.insert(0, str(REPO / "tests"))
from test_golden import ARGS, digest, machine, rows_of  # noqa: E402


def capture(tree: Path, out: Path) -> list[dict]:
    subprocess.run([*CLI, *ARGS, "--out", str(out)], cwd=tree, check=True, capture_output=True)
    return [digest(r) for r in rows_of(out)]


def main(commits: list[str]) -> None:
    header()
    print(torch_cpu(), "|", machine()["cpu"])
    with tempfile.TemporaryDirectory() as tmp:
        now = capture(REPO, Path(tmp) / "now")
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        print(f"| code | rows | tokens | decoded fields identical to the working tree ({head.stdout.strip()}+) |")
        print("|---|---|---|---|")
        for commit in commits:
            tree = Path(tmp) / commit
            subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), commit], cwd=REPO, check=True)
            try:
                then = capture(tree, Path(tmp) / f"run-{commit}")
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=True)
            print(f"| {commit} | {len(then)} | {sum(r['tokens'] for r in then)} | {then == now} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["e5ec26d", "8cea61d"])
