"""Two builds of helios served in turns on one core: is a change faster, on a host whose speed drifts?

Each build is a git revision (or WORKTREE for the checkout as it is), exported into its own
directory; every run starts `python -m helios serve` from that directory, so that build's helios is
the one imported (`python -m` puts its working directory ahead of PYTHONPATH: starting both from the
checkout would compare the checkout with itself). Runs alternate A B B A ..., so a slow stretch of
the host falls on both builds alike, and the report gives each build's figures, medians, and how
many pairs each won. Each build keeps its own native-kernel build and remembered host measurements
(~/.cache/flare), as a user upgrading would.

Usage: .venv/bin/python benchmarks/ab_builds.py CORE REV_A REV_B [--rounds 6] [--scenario single|16|64...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import compare

WORKTREE = "WORKTREE"


def export(rev: str, into: Path) -> Path:
    """The tree of `rev` in a directory of its own (WORKTREE: the checkout itself)."""
    if rev == WORKTREE:
        return compare.ROOT
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=compare.ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def serve_once(tree: Path, core: Path, scenario: str, workdir: Path) -> dict:
    """One server of the build in `tree`, one scenario: its serve_bench figures."""
    if scenario == "single":
        return compare.run_helios(core, 2, ["single"], workdir, tree=tree)["single"]
    return compare.run_helios(core, 2, ["sweep"], workdir, levels=(int(scenario),), tree=tree)["sweep"][scenario]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core", type=Path)
    parser.add_argument("a", help="git revision of build A (WORKTREE: the checkout as it is)")
    parser.add_argument("b", help="git revision of build B")
    parser.add_argument("--rounds", type=int, default=6, help="pairs of runs (default 6)")
    parser.add_argument("--scenario", default="single", help="'single', or a concurrency level of the sweep")
    args = parser.parse_args()
    if args.scenario != "single" and not args.scenario.isdigit():
        parser.error("--scenario takes 'single' or a number of concurrent streams")
    with tempfile.TemporaryDirectory(prefix="ab-builds-") as scratch:
        workdir = Path(scratch)
        trees = {name: export(rev, workdir / name) for name, rev in (("A", args.a), ("B", args.b))}
        figures: dict[str, list[float]] = {"A": [], "B": []}
        for turn in range(args.rounds):
            for name in ("A", "B") if turn % 2 == 0 else ("B", "A"):
                got = serve_once(trees[name], args.core.resolve(), args.scenario, workdir)
                figures[name].append(got["output_tok_s"])
                print(f"round {turn} {name}: {got['output_tok_s']} tok/s, inter-token p50 {got['itl_p50_ms']} ms")
        wins = sum(b > a for a, b in zip(figures["A"], figures["B"]))
        for name, rev in (("A", args.a), ("B", args.b)):
            values = sorted(figures[name])
            print(f"{name} ({rev}): {values}, median {values[len(values) // 2]}")
        print(f"B ahead in {wins} of {args.rounds} pairs")


if __name__ == "__main__":
    sys.exit(main())
