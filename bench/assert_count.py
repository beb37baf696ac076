"""Count the assertions of the test suite per file: ``assert`` statements and ``pytest.raises`` blocks.

Issue 29's rule for making the suite faster: no assertion may go. This script counts both kinds in every
``tests/*.py`` file (fixtures and helpers included) of the working tree and, with ``--before REV``, of a git
revision, and prints them side by side with the totals. Exits 1 when the working tree has fewer of either.

    python bench/assert_count.py --before e5ec26d
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys

from harness import REPO


def count(source: str) -> tuple[int, int]:
    """(assert statements, ``pytest.raises`` calls) in one Python source."""
    tree = ast.parse(source)
    asserts = sum(isinstance(n, ast.Assert) for n in ast.walk(tree))
    raises = sum(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "raises"
                 and isinstance(n.func.value, ast.Name) and n.func.value.id == "pytest" for n in ast.walk(tree))
    return asserts, raises


def tree_counts() -> dict[str, tuple[int, int]]:
    return {p.name: count(p.read_text()) for p in sorted((REPO / "tests").glob("*.py"))}


def rev_counts(rev: str) -> dict[str, tuple[int, int]]:
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:tests"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: count(subprocess.run(["git", "show", f"{rev}:tests/{n}"], cwd=REPO, check=True, capture_output=True,
                                    text=True).stdout) for n in sorted(names) if n.endswith(".py")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a git revision to compare with (e.g. the commit before a change)")
    args = ap.parse_args()
    now = tree_counts()
    before = rev_counts(args.before) if args.before else {}
    print(f"{'file':<24} {'asserts':>8} {'raises':>7}" + (f"   {'before':>8} {'raises':>7}" if before else ""))
    for name in sorted(set(now) | set(before)):
        a, r = now.get(name, (0, 0))
        line = f"{name:<24} {a:>8} {r:>7}"
        if before:
            b, s = before.get(name, (0, 0))
            line += f"   {b:>8} {s:>7}"
        print(line)
    total = tuple(map(sum, zip(*now.values())))
    line = f"{'total':<24} {total[0]:>8} {total[1]:>7}"
    if before:
        old = tuple(map(sum, zip(*before.values())))
        line += f"   {old[0]:>8} {old[1]:>7}"
        print(line)
        if total[0] < old[0] or total[1] < old[1]:
            print("fewer assertions than before", file=sys.stderr)
            return 1
        return 0
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
