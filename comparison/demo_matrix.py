"""Does `python train.py` learn from every warm start its code builds? One run per cell of
warm-start seed x thread count x RL seed, with the default flags otherwise.

    python comparison/demo_matrix.py --output-dir runs/matrix          # 3 x 2 x 2 = 12 cells
    python comparison/demo_matrix.py --output-dir runs/matrix-columns --task columns   # the written-work task
    python comparison/demo_matrix.py --output-dir runs/m --warm-start-seeds 0 --rl-seeds 0 --threads 2

Each thread count builds its own models (a cache folder per thread count): float rounding may differ
between 1 and 2 threads, so the warm start may too (it did for the earlier one-phase warm start; on
this machine, for the two-phase one, seeds 1 and 2 came out the same at 1 and 2 threads, and their
RL runs too: the matrix of 2026-11-30 has 8 distinct outcomes in its 12 cells). Warm-start seed 0 is the model shipped in
demo/ (the same on every machine); other seeds are built on this machine. Cells run one
at a time, except that --parallel 2 runs two 1-thread cells side by side (one core each). A cell
whose run folder holds a finished run is read back, not run again. Prints one line per cell (start
and end accuracy, gain, wall seconds of train.py, warm-start build excluded) and a summary.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from infra import cli  # noqa: E402
import records  # noqa: E402


def environment(out: str, threads: int) -> dict:
    """``threads`` torch threads, and the models of that thread count in a cache of their own."""
    return records.threads_env(threads, REPLAY_RL_CACHE=os.path.join(out, f"models-t{threads}"), HF_HUB_OFFLINE="1",
                               HF_DATASETS_OFFLINE="1")


def run_cell(out: str, task: str, ws: int, threads: int, seed: int, extra: list[str]) -> dict:
    """One train.py run on a built model; its first/final accuracy and wall time. A cell run before
    with the same flags is read back (cell.json), one of other flags run again."""
    run_dir = os.path.join(out, f"{task}-ws{ws}-t{threads}-seed{seed}")
    argv = ["--task", task, "--warm-start-seed", str(ws), "--seed", str(seed), "--no-progress", "--no-plot",
            "--output-dir", run_dir, *extra]
    done = os.path.join(run_dir, "cell.json")
    if os.path.exists(done):
        with open(done) as f:
            cell = json.load(f)
        if cell.get("argv") == argv:
            return cell
    start = time.perf_counter()
    records.run_train(argv, run_dir, environment(out, threads))
    seconds = time.perf_counter() - start
    evals = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "eval_accuracy" in r]
    cell = {"warm_start_seed": ws, "threads": threads, "seed": seed, "first": evals[0]["eval_accuracy"],
            "final": evals[-1]["eval_accuracy"], "evals": [e["eval_accuracy"] for e in evals], "seconds": seconds,
            "argv": argv}
    cell["gain"] = cell["final"] - cell["first"]
    with open(done, "w") as f:
        json.dump(cell, f)
    return cell


def line(c: dict, goal: float) -> str:
    return (f"warm-start seed {c['warm_start_seed']}, {c['threads']} thread(s), RL seed {c['seed']}: "
            f"{c['first']:.3f} -> {c['final']:.3f} ({c['gain']:+.3f}{'' if c['gain'] >= goal else ' BELOW GOAL'}) "
            f"in {c['seconds']:.0f} s")


def main(argv=None) -> list[dict]:
    p = cli.OneLineParser(prog="demo_matrix.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", required=True, help="one run folder per cell, and the models built")
    p.add_argument("--task", default="addition", choices=("addition", "columns"), help="the embedded task")
    p.add_argument("--warm-start-seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rl-seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--parallel", type=int, default=1, choices=(1, 2), help="1-thread cells side by side")
    p.add_argument("--goal", type=float, default=0.20, help="the gain every cell should reach")
    args, extra = p.parse_known_args(argv)          # anything else goes to train.py
    os.makedirs(args.output_dir, exist_ok=True)
    cells = list(itertools.product(args.warm_start_seeds, args.threads, args.rl_seeds))
    results = []
    for threads in args.threads:
        mine = [c for c in cells if c[1] == threads]
        workers = args.parallel if threads == 1 else 1
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda ws: records.build_tiny_model(args.task, ws, env=environment(args.output_dir, threads)),
                          args.warm_start_seeds))
            for cell in pool.map(lambda c: run_cell(args.output_dir, args.task, *c, extra), mine):
                print(line(cell, args.goal), flush=True)
                results.append(cell)
    gains, seconds = [c["gain"] for c in results], [c["seconds"] for c in results]
    print(f"summary over {len(results)} cells: gain min {min(gains):+.3f} / median {statistics.median(gains):+.3f} "
          f"/ max {max(gains):+.3f}; cells at or above {args.goal:+.2f}: {sum(g >= args.goal for g in gains)}"
          f"/{len(gains)}; train.py wall time min {min(seconds):.0f} s / max {max(seconds):.0f} s")
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
