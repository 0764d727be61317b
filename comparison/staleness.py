"""How stale is replayed data on the written-work task (--task columns), and when does the importance
cap bind? One train.py run per setting x warm start; the figures the loss logs, per run and per setting.

    python comparison/staleness.py --output-dir runs/stale --json docs/staleness.json

Settings (each the task's default run, 50 rounds, but for the flags named): the default replay (y = 2,
R = 128, B = N = 256), y = 4 (N = 4R: R = 64), y = 8 (R = 32), a buffer twice as deep as the batch
(R = 64, B = 256, N = 512: replay ratio 4, rollouts kept 8 rounds), and larger learning rates at y = 2
and y = 4. Per run: the mean completion length, the fraction of completion tokens whose importance
weight was cut to the cap C = 2 (is_truncated_frac: mean over steps, largest step), rollout age in
optimizer steps (mean, largest), the spread of the importance ratio rho (is_ratio_mean's range over
steps, is_ratio_max's median and largest), approx_kl's largest step, and the eval accuracies. Runs go
one thread each, --parallel side by side; a finished run is read back, not run again.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from infra import cli  # noqa: E402
import records  # noqa: E402

SETTINGS = {
    "y2 (default)": [],
    "y4": ["--prompts-per-round", "8"],
    "y8": ["--prompts-per-round", "4"],
    "y4, N = 2B": ["--prompts-per-round", "8", "--buffer-size", "512"],
    "y2, lr 4e-3": ["--lr", "4e-3"],
    "y4, lr 2e-3": ["--prompts-per-round", "8", "--lr", "2e-3"],
    "y4, lr 4e-3": ["--prompts-per-round", "8", "--lr", "4e-3"],
}


def run(out: str, name: str, ws: int) -> dict:
    """One run of a setting from warm start ws (RL seed ws), one thread; run again only if its flags changed."""
    folder = os.path.join(out, name.replace(" ", "").replace(",", "_").replace("=", ""), f"ws{ws}")
    records.run_train(["--task", "columns", "--warm-start-seed", str(ws), "--seed", str(ws), "--eval-every", "10",
                       "--no-progress", "--no-plot", "--output-dir", folder, *SETTINGS[name]], folder,
                      records.threads_env(1, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
    return figures(folder)


def figures(folder: str) -> dict:
    """The staleness figures of one run folder (see the module docstring)."""
    rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    steps = [r for r in rows if "is_truncated_frac" in r]
    col = lambda k: [r[k] for r in steps]
    return {
        "completion_len": statistics.fmean(col("completion_len")),
        "truncated_frac_mean": statistics.fmean(col("is_truncated_frac")),
        "truncated_frac_max": max(col("is_truncated_frac")),
        "age_mean": statistics.fmean(col("age_mean")), "age_max": max(col("age_max")),
        "is_ratio_mean_range": [min(col("is_ratio_mean")), max(col("is_ratio_mean"))],
        "is_ratio_max_median": statistics.median(col("is_ratio_max")), "is_ratio_max_max": max(col("is_ratio_max")),
        "approx_kl_max": max(col("approx_kl")),
        "entropy_first_last": [steps[0]["entropy"], steps[-1]["entropy"]],
        "evals": [r["eval_accuracy"] for r in rows if "eval_accuracy" in r],
    }


def main(argv=None) -> dict:
    p = cli.OneLineParser(prog="staleness.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", required=True, help="one run folder per setting and warm start")
    p.add_argument("--warm-start-seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="the replicates: warm start i with RL seed i")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), metavar="NAME")
    p.add_argument("--parallel", type=int, default=2, help="runs side by side, one thread each")
    p.add_argument("--json", default="", help="write the figures here too")
    args = p.parse_args(argv)
    cells = [(name, ws) for name in args.settings for ws in args.warm_start_seeds]
    with ThreadPoolExecutor(args.parallel) as pool:
        done = list(pool.map(lambda c: run(args.output_dir, *c), cells))
    runs = {name: {} for name in args.settings}
    for (name, ws), fig in zip(cells, done):
        runs[name][ws] = fig
    print(f"{'setting':<14}{'len':>6}{'trunc mean':>12}{'trunc max':>11}{'age':>6}{'age max':>8}"
          f"{'rho mean range':>18}{'rho max med':>12}{'final acc':>22}")
    summary = {}
    for name, per_ws in runs.items():
        figs = list(per_ws.values())
        s = summary[name] = {
            "flags": SETTINGS[name], "per_warm_start": per_ws,
            "completion_len": statistics.fmean(f["completion_len"] for f in figs),
            "truncated_frac_mean": statistics.fmean(f["truncated_frac_mean"] for f in figs),
            "truncated_frac_max": max(f["truncated_frac_max"] for f in figs),
            "age_mean": statistics.fmean(f["age_mean"] for f in figs), "age_max": max(f["age_max"] for f in figs),
            "is_ratio_mean_range": [min(f["is_ratio_mean_range"][0] for f in figs),
                                    max(f["is_ratio_mean_range"][1] for f in figs)],
            "is_ratio_max_median": statistics.median(f["is_ratio_max_median"] for f in figs),
            "final_accuracy": [f["evals"][-1] for f in figs],
        }
        lo, hi = s["is_ratio_mean_range"]
        print(f"{name:<14}{s['completion_len']:>6.1f}{s['truncated_frac_mean']:>12.5f}{s['truncated_frac_max']:>11.4f}"
              f"{s['age_mean']:>6.2f}{s['age_max']:>8.0f}{f'{lo:.4f}-{hi:.4f}':>18}{s['is_ratio_max_median']:>12.2f}"
              f"{' '.join(f'{a:.2f}' for a in s['final_accuracy']):>22}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python comparison/staleness.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "settings": summary}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
