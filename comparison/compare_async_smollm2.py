"""The powered SmolLM2 comparison of issue 52, planned and not run: four arms on
SmolLM2-135M-Instruct, --task sums, as many seeds as comparison/power.py asks, a target and its
rule fixed before the runs.

    python comparison/compare_async_smollm2.py --print       # the compare.py command, nothing run
    python comparison/compare_async_smollm2.py                # run it (needs train.py --generators)

The arms (B = 16, G = 4; every arm stores only groups whose rewards differ and steps once S new
rollouts are stored; y = B / S uses of each stored rollout):
  on_policy        the synchronous loop (--generators 0), S = B = N = 16, one prompt a round
                   (P = 1): a round stores
                   0 or G rollouts and S is a multiple of G, so the cap never throws one away
                   (records.discards_possible)
  async_on_policy  one generation worker (--generators 1), S = B = N = 16, P = 4
  async_replay     one worker, the paper's buffer with y fixed at 2: S = 8, N = B = 16, P = 4
  async_control    one worker, B = S = 8, N = 16, --no-reuse (each rollout used once: sampled
                   rollouts leave the buffer), P = 4: as many steps per stored rollout as
                   async_replay, no reuse; it differs from async_replay in B and reuse (a control
                   with the same B and no reuse would take half the steps: that is
                   async_on_policy). N = 16 holds a whole round: with workers every round is stored
Every flag each pair differs in is in summary.json ("differs") and on the page.
The target: 0.45, fixed before the runs (on the rise of the committed comparison's curves, from
0.165 at the start to on-policy's final 0.58), rule "first": each replicate's first eval at or
above it, paired per replicate; beside it the mean accuracy over the tokens (the area), paired.
The grid, the budget, the evals and the lr are those of docs/results/smollm2_filtered.json, whose
per-seed spread docs/results/smollm2_power.json reads, so that its power statement applies.
The seeds: its seeds_planned.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

POWER = "docs/results/smollm2_power.json"
COMMON = ("--prompts-per-round {P} --buffer-size {N} --batch-size {B} --skip-zero-advantage "
          "--new-per-update {S}")
ARMS = {   # name: (async worker flags, P, N, B, S)
    "on_policy": ("--generators 0", 1, 16, 16, 16),
    "async_on_policy": ("--generators 1", 4, 16, 16, 16),
    "async_replay": ("--generators 1", 4, 16, 16, 8),
    "async_control": ("--generators 1 --no-reuse", 4, 16, 8, 8),
}
PAIRS = ("async_replay:async_on_policy", "async_replay:async_control")


def arm_flags(name: str) -> str:
    extra, P, N, B, S = ARMS[name]
    return " ".join(filter(None, [extra, COMMON.format(P=P, N=N, B=B, S=S)]))


def compare_argv(seeds: int, jobs: int = 1, output_dir: str = "runs/smollm2_async",
                 records: str = "docs/results/records/smollm2_async") -> list[str]:
    """compare.py's flags for the planned comparison."""
    argv = ["--model", "smollm2", "--task", "sums", "--num-generations", "4", "--batch-size", "16",
            "--replay-ratio", "2", "--lr", "2.5e-4", "--arms", *ARMS]
    for name in ARMS:
        argv += ["--arm", name, arm_flags(name)]
    return argv + ["--pairs", *PAIRS, "--target", "0.45", "--target-rule", "first",
                   "--seeds", str(seeds), "--budget-tokens", "16000", "--early-tokens", "6000",
                   "--early-evals", "6", "--evals", "3", "--eval-prompts", "200",
                   "--jobs", str(jobs), "--records", records, "--output-dir", output_dir,
                   "--train-args", "--temperature 0.7"]


def command(argv: list[str]) -> str:
    """The command as docs/results.md shows it, within 100 characters: short flags share a line; a
    long value of train.py flags is wrapped inside its quotes between two of its flags (shlex.split
    reads it alike)."""
    groups = [["python comparison/compare.py"]]
    for x in argv:
        if x.startswith("--") and " " not in x:        # a flag of compare.py, not a value of flags
            groups.append([])
        groups[-1].append(shlex.quote(x))
    lines = [" ".join(groups[0])]
    for g in groups[1:]:
        line = " ".join(g)
        if len(line) > 90:
            units = re.split(r" (?=--)", line)      # each train.py flag with its value
            wrapped = [units[0]]
            for unit in units[1:]:
                if len(wrapped[-1]) + 1 + len(unit) > 90:
                    wrapped.append(unit)
                else:
                    wrapped[-1] += " " + unit
            lines.append("\n        ".join(wrapped))
        elif len(lines) > 1 and "\n" not in lines[-1] and len(lines[-1]) + len(line) < 90:
            lines[-1] += " " + line
        else:
            lines.append(line)
    return " \\\n    ".join(lines)


def differences_table() -> str:
    """Each arm's flags, and what each pair the comparison reads differs in (records.flags_differ):
    every difference between two arms of a pair, nothing else."""
    import records
    flags = {a: shlex.split(arm_flags(a)) for a in ARMS}
    lines = ["| arm | P, N, B, S | generation | uses of a stored rollout (B / S) |",
             "|---|---|---|---|"]
    for a, (extra, P, N, B, S) in ARMS.items():
        how = "synchronous" if extra == "--generators 0" else "one worker, async"
        lines.append(f"| {a} | {P}, {N}, {B}, {S} | {how} | {B / S:g} |")
    lines += ["", "| pair (arm / reference) | flags that differ (arm, reference) |", "|---|---|"]
    pairs = [(a, "on_policy") for a in ARMS if a != "on_policy"]
    pairs += [tuple(p.split(":")) for p in PAIRS]
    for a, b in pairs:
        d = records.flags_differ(flags[a], flags[b])
        cells = "; ".join(f"{k} {x}, {y}" for k, (x, y) in d.items())
        lines.append(f"| {a} / {b} | {cells} |")
    return "\n".join(lines)


def planned_seeds() -> int:
    return json.load(open(os.path.join(ROOT, POWER)))["seeds_planned"]


def main(argv=None):
    p = argparse.ArgumentParser(prog="compare_async_smollm2.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print", action="store_true",
                   help="print the compare.py command and run nothing")
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (an async run's two "
                   "processes take both cores: 1 for honest wall seconds)")
    args = p.parse_args(argv)
    cmd = compare_argv(planned_seeds(), args.jobs)
    print(command(cmd), flush=True)
    if not args.print:
        import compare
        return compare.main(cmd)


if __name__ == "__main__":
    main()
