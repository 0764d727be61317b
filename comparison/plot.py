"""Curves of runs, and of compare.py's arms, drawn from their files.

    python comparison/plot.py runs/X                           # runs/X/curves.png: one run, every health signal
    python comparison/plot.py runs/A runs/B -o overlay.png     # several runs: accuracy against tokens and seconds

One run's figure is infra/curves.py's (train.py draws it too, as curves.png); this file overlays several
runs (plot_runs) and draws compare.py's arms from a summary (plot_arms), with curves.py's helpers.
The standard library only, plus matplotlib when drawing: without it each function prints how to
get it and returns None.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                # the project's modules (infra/curves.py)

from infra import curves  # noqa: E402


def run_names(run_dirs: list[str]) -> list[str]:
    """The shortest trailing parts of the paths that tell the runs apart: runs/cmp/replay/seed0 -> replay/seed0."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in run_dirs]
    for k in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-k:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [os.path.normpath(d) for d in run_dirs]


def _figure_legend(fig, ax, title: str | None = None) -> None:
    """One legend for the figure, below the panels, so it covers no data."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(handles), 6), title=title, fontsize=9)


# ---- several runs, and the arms of compare.py ------------------------------------------------
def plot_runs(run_dirs: list[str], path: str, labels: list[str] | None = None):
    """Overlay runs, one colour each: held-out accuracy against generated tokens and against seconds,
    the sampled reward (running mean) against tokens. Writes path; returns the Figure (None without matplotlib)."""
    fig = curves.new_figure(path, (18, 5.5))
    if fig is None:
        return None
    labels = labels or run_names(run_dirs)
    acc_tokens, acc_seconds, reward = fig.subplots(1, 3)
    for i, (run_dir, label) in enumerate(zip(run_dirs, labels)):
        steps, evals = curves.read_metrics(run_dir)
        color = f"C{i % 10}"
        curves.series(acc_tokens, evals, "gen_tokens", "eval_accuracy", label, color)
        curves.series(acc_seconds, evals, "seconds", "eval_accuracy", label, color)
        curves.series(reward, steps, "gen_tokens", "reward", label, color,
                      curves.smoothing_window(len(steps)))
    curves.accuracy_axes(acc_tokens, "generated completion tokens",
                         "held-out accuracy against generated tokens", counts=True)
    curves.accuracy_axes(acc_seconds, "seconds generating + training (evals excluded)",
                         "held-out accuracy against time")
    curves.count_axis(reward)
    reward.set_ylabel("mean sampled reward of the newest round")
    reward.set_title("sampled reward (faint: every step; bold: running mean)", fontsize=11)
    reward.grid(alpha=0.3)
    _figure_legend(fig, acc_tokens)
    curves.save(fig, path, dpi=110)
    return fig


def plot_arms(summary: dict, path: str):
    """compare.py's figure: per arm, the mean accuracy over seeds with a min-max band, against generated
    tokens, measured seconds and, with a cost curve, the seconds PROJECTED on its first curve. Reads
    summary["arms"][name]["curve"] (tokens, seconds, accuracy, min, max, projected: {curve: seconds}),
    summary["target_accuracy"] and summary["cost"]. Returns the Figure (None without matplotlib)."""
    cost_curves = (summary.get("cost") or {}).get("curves") or []
    fig = curves.new_figure(path, (16 if cost_curves else 11, 5))
    if fig is None:
        return None
    keys = ("tokens", "seconds", "projected")[:3 if cost_curves else 2]
    axes = fig.subplots(1, len(keys))
    for i, (name, arm) in enumerate(summary["arms"].items()):
        c = arm["curve"]
        xs = {"tokens": c["tokens"], "seconds": c["seconds"],
              "projected": cost_curves and c["projected"][cost_curves[0]]}
        for ax, key in zip(axes, keys):
            ax.plot(xs[key], c["accuracy"], label=name, marker=".", color=f"C{i % 10}", gid=name)
            ax.fill_between(xs[key], c["min"], c["max"], alpha=0.12, color=f"C{i % 10}")
    target = summary["target_accuracy"]
    titles = ("against generated tokens", "against measured time",
              f"against PROJECTED time ({cost_curves[0] if cost_curves else ''} curve)")
    labels = ("generated completion tokens", "measured seconds (generation + training)",
              f"seconds on {(summary.get('cost') or {}).get('file')}: rounds x gen(R) + steps x train(B)")
    for ax, title, label in zip(axes, titles, labels):
        frac = summary.get("target_frac", 1.0)
        rule = "on-policy final accuracy" if frac == 1.0 else f"on-policy start + {frac:g} of its gain"
        ax.axhline(target, label=f"target {target:.3f} ({rule})", **curves.REFERENCE)
        curves.accuracy_axes(ax, label, title, counts=ax is axes[0])
    _figure_legend(fig, axes[0], title="mean over seeds; band: min-max")
    curves.save(fig, path, dpi=110)
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Plot runs of train.py: one folder gives its health panels "
                                            "(curves.png in the folder), several an overlay of their accuracy.")
    p.add_argument("runs", nargs="+", help="run folders, each with a metrics.jsonl")
    p.add_argument("--output", "-o", default="",
                   help="the PNG to write (default: RUN/curves.png for one run, overlay.png here for several)")
    args = p.parse_args(argv)
    for run_dir in args.runs:
        if not os.path.isdir(run_dir):
            print(f"error: {run_dir}: no such folder", file=sys.stderr)
            return 2
        if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
            print(f"error: {run_dir} has no metrics.jsonl (not a run folder of train.py?)", file=sys.stderr)
            return 2
    if len(args.runs) == 1:
        path = args.output or os.path.join(args.runs[0], "curves.png")
        fig = curves.plot_run(args.runs[0], path)
    else:
        path = args.output or "overlay.png"
        fig = plot_runs(args.runs, path)
    if fig is None:
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
