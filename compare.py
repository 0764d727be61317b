"""Does replay pay off? Arms of train.py's loop under the same budget of generated tokens.

    python compare.py --output-dir runs/compare            # the full comparison (~12 min on 2 CPU cores)
    python compare.py --quick --output-dir /tmp/cmp        # the pipeline in ~1 minute

Arms (B = batch size, y = replay ratio, G = num_generations; every arm K = 1 update per round):
    on_policy   R = B fresh rollouts per update, N = B: each rollout used once, right away
    replay      the paper's form: R = B/y fresh rollouts per update, N = B, same B and lr:
                each update mixes the newest R rollouts with y-1 older rounds; each rollout used y times
    control     on-policy with R = B = N = B/y: as many updates per generated token as replay,
                with no reuse; it separates "reuse" from "more, smaller updates"
  optional (flags): replay_pbr (positive-bias retention), replay_nonzero (only rollouts with a
                non-zero advantage are kept), replay_ppo (the clipped loss), replay_asymre (AsymRE)
Runs go one at a time, so the measured seconds of one run are not slowed by another.

Cost model. Let mu = (generation seconds per rollout) / (training seconds per rollout). In units
of one training rollout, a round costs mu*R + K*B. Replay saves generated rollouts but adds
trained ones, so it pays in wall time only when mu > break-even = (extra trained rollouts) /
(saved generated rollouts), both counted up to the target accuracy.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ARMS = ("on_policy", "replay", "control")
OPTIONAL_ARMS = ("replay_pbr", "replay_nonzero", "replay_ppo", "replay_asymre")


def arm_flags(arm: str, batch: int, y: int, G: int, delta: float) -> list[str]:
    """train.py flags that define an arm: prompts per round P (R = P*G), buffer N, batch B, extras."""
    if arm == "on_policy":
        P, N, B = batch // G, batch, batch
    elif arm == "control":
        P, N, B = batch // (y * G), batch // y, batch // y
    else:
        P, N, B = batch // (y * G), batch, batch
    extra = {"replay_pbr": ["--keep-correct-frac", str(delta)], "replay_nonzero": ["--skip-zero-advantage"],
             "replay_ppo": ["--loss", "ppo"], "replay_asymre": ["--loss", "asymre"]}.get(arm, [])
    return ["--prompts-per-round", str(P), "--buffer-size", str(N), "--batch-size", str(B)] + extra


def read_run(run_dir: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    steps = [r for r in rows if "eval_accuracy" not in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    last = rows[-1]                                      # every line carries the cumulative counters
    tail = steps[-max(1, len(steps) // 20):]             # entropy: mean over the last 5% of steps
    return {
        "tokens": [r["gen_tokens"] for r in evals],
        "steps": [r["step"] for r in evals],
        "seconds": [r["gen_seconds"] + r["train_seconds"] for r in evals],
        "accuracy": [r["eval_accuracy"] for r in evals],
        "entropy": statistics.mean(r["rollout_entropy"] for r in tail) if tail else float("nan"),
        "gen_seconds": last["gen_seconds"], "train_seconds": last["train_seconds"],
        "rollouts_generated": last["round"] * cfg["prompts_per_round"] * cfg["num_generations"],
        "rollouts_trained": last["step"] * cfg["batch_size"],
        "batch_size": cfg["batch_size"],
    }


def median_curve(runs: list[dict], grid: list[float]) -> dict[str, list[float]]:
    """The runs' evals at common token counts: at each grid point g, every run's first eval with
    generated tokens >= g (train.py evaluates when the tokens cross each multiple of the interval,
    and at the end). Median over runs of tokens, seconds, updates and accuracy; min and max accuracy."""
    picks = [[next(i for i, t in enumerate(r["tokens"]) if t >= g) for g in grid] for r in runs]
    curve = {key: [statistics.median(r[key][p[j]] for r, p in zip(runs, picks)) for j in range(len(grid))]
             for key in ("tokens", "seconds", "steps", "accuracy")}
    curve["min"] = [min(r["accuracy"][p[j]] for r, p in zip(runs, picks)) for j in range(len(grid))]
    curve["max"] = [max(r["accuracy"][p[j]] for r, p in zip(runs, picks)) for j in range(len(grid))]
    return curve


def break_even_mu(gen_on: float, trained_on: float, gen_replay: float, trained_replay: float) -> float | None:
    """The mu above which replay costs less to reach the target, in the cost model
    cost = mu * (rollouts generated) + (rollouts trained):
        mu * gen_replay + trained_replay < mu * gen_on + trained_on
        <=>  mu > (trained_replay - trained_on) / (gen_on - gen_replay)   when replay generates less.
    0.0: replay is cheaper at any mu. None: replay generated no less, so a costlier generation only
    favours on-policy (if replay also trained less, it is cheaper below (extra / saved) only)."""
    saved, extra = gen_on - gen_replay, trained_replay - trained_on
    if saved > 0:
        return max(extra / saved, 0.0)
    return 0.0 if saved == 0 and extra < 0 else None


def first_reach(xs: list[float], accs: list[float], target: float, window: int = 3) -> float | None:
    """x of the first eval point from which the mean accuracy of the next ``window`` points (fewer
    at the end) reaches the target: one lucky eval does not count as reaching it."""
    for i, x in enumerate(xs):
        ahead = accs[i:i + window]
        if sum(ahead) / len(ahead) >= target - 1e-9:
            return x
    return None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="runs/compare", help="folder for the runs, summary.json and curves.png")
    p.add_argument("--budget-tokens", type=int, default=450_000, help="generated completion tokens per run")
    p.add_argument("--seeds", type=int, default=3, help="seeds per arm")
    p.add_argument("--batch-size", type=int, default=256, help="B, rollouts per update of the on-policy and replay arms")
    p.add_argument("--replay-ratio", type=int, default=2, choices=(2, 4), help="y: uses of each rollout in the replay arm")
    p.add_argument("--num-generations", type=int, default=8, help="G, samples per prompt")
    p.add_argument("--lr", type=float, default=1e-3, help="one learning rate for every arm (unless --sweep-lr)")
    p.add_argument("--sweep-lr", type=float, nargs="*", default=None,
                   help="learning rates to try per arm (one seed each); the best final accuracy is used")
    p.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS + OPTIONAL_ARMS, help="arms to run")
    p.add_argument("--keep-correct-frac", type=float, default=0.3, help="delta of the positive-bias retention arm")
    p.add_argument("--evals", type=int, default=15, help="eval points per run")
    p.add_argument("--eval-prompts", type=int, default=500, help="held-out prompts per eval")
    p.add_argument("--model", default="tiny", help="passed to train.py")
    p.add_argument("--task", default="addition", help="passed to train.py")
    p.add_argument("--quick", action="store_true", help="a small budget, 2 seeds, 200 eval prompts: checks the pipeline")
    p.add_argument("--train-args", default="", help="more train.py flags for every run, as one string")
    args = p.parse_args(argv)
    if args.quick:
        args.budget_tokens, args.seeds, args.eval_prompts, args.evals = 30_000, 2, 200, 4
    if "on_policy" not in args.arms:
        p.error("--arms must include on_policy (it sets the target)")
    if args.batch_size % (args.replay_ratio * args.num_generations):
        p.error(f"--batch-size {args.batch_size} must be a multiple of replay_ratio x num_generations "
                f"= {args.replay_ratio * args.num_generations}")

    import train
    os.makedirs(args.output_dir, exist_ok=True)
    y, B, G = args.replay_ratio, args.batch_size, args.num_generations
    interval = -(-args.budget_tokens // args.evals)                   # ceil: the last threshold is the budget
    grid = [k * interval for k in range(args.evals)] + [args.budget_tokens]

    def run(arm: str, seed: int, lr: float, tag: str = "") -> dict:
        flags = arm_flags(arm, B, y, G, args.keep_correct_frac)
        out = os.path.join(args.output_dir, arm + tag, f"seed{seed}")
        # Every run evaluates when its generated tokens cross the same thresholds: curves line up.
        argv = flags + ["--seed", str(seed), "--lr", str(lr), "--output-dir", out, "--model", args.model,
                        "--task", args.task, "--num-generations", str(G), "--max-gen-tokens", str(args.budget_tokens),
                        "--max-rounds", str(10**9), "--eval-every-tokens", str(interval),
                        "--eval-prompts", str(args.eval_prompts), "--no-progress"] + args.train_args.split()
        train.main(argv)
        return read_run(out)

    lrs = {}
    start = time.time()
    for arm in args.arms:
        if args.sweep_lr:
            # seed 1000: the sweep's runs are not among the reported seeds (no selection on them)
            scores = {lr: run(arm, 1000, lr, f"-lr{lr:g}")["accuracy"][-1] for lr in args.sweep_lr}
            lrs[arm] = max(scores, key=scores.get)
            print(f"{arm}: lr sweep {scores} -> {lrs[arm]:g}", flush=True)
        else:
            lrs[arm] = args.lr
    results = {}
    for arm in args.arms:
        results[arm] = []
        for seed in range(args.seeds):
            results[arm].append(run(arm, seed, lrs[arm]))
            print(f"{arm} seed {seed}: final accuracy {results[arm][-1]['accuracy'][-1]:.3f} "
                  f"({time.time() - start:.0f} s so far)", flush=True)

    # mu, measured on the on-policy arm: seconds per generated rollout / seconds per trained rollout.
    op = results["on_policy"]
    mu = statistics.median((r["gen_seconds"] / r["rollouts_generated"]) / (r["train_seconds"] / r["rollouts_trained"])
                           for r in op)
    target = statistics.median(r["accuracy"][-1] for r in op)
    summary = {"target_accuracy": target, "mu": mu, "budget_tokens": args.budget_tokens,
               "lr": {a: lrs[a] for a in args.arms}, "lr_chosen_by": "sweep" if args.sweep_lr else "given",
               "seconds_measured": "one run at a time, generation + training (evals excluded)", "arms": {}}
    for arm, runs in results.items():
        curve = median_curve(runs, grid)
        rollouts_per_token = statistics.median(r["rollouts_generated"] / max(r["tokens"][-1], 1) for r in runs)
        tokens_to_target = first_reach(curve["tokens"], curve["accuracy"], target)
        steps_to_target = first_reach(curve["steps"], curve["accuracy"], target)
        summary["arms"][arm] = {
            "final_accuracy": statistics.median(r["accuracy"][-1] for r in runs),
            "final_accuracy_range": [min(r["accuracy"][-1] for r in runs), max(r["accuracy"][-1] for r in runs)],
            "tokens_to_target": tokens_to_target,
            "seconds_to_target": first_reach(curve["seconds"], curve["accuracy"], target),
            "steps_to_target": steps_to_target,
            "entropy": statistics.median(r["entropy"] for r in runs),
            "seeds": len(runs),
            "gen_seconds": statistics.median(r["gen_seconds"] for r in runs),
            "train_seconds": statistics.median(r["train_seconds"] for r in runs),
            "flags": " ".join(arm_flags(arm, B, y, G, args.keep_correct_frac)),
            "curve": curve,
            # rollouts generated and trained up to the target, for the cost model
            "_gen_to_target": tokens_to_target * rollouts_per_token if tokens_to_target is not None else None,
            "_trained_to_target": steps_to_target * runs[0]["batch_size"] if steps_to_target is not None else None,
        }
    base = summary["arms"]["on_policy"]
    candidates = [a for a in summary["arms"] if a not in ("on_policy", "control")
                  and summary["arms"][a]["tokens_to_target"] is not None]
    best = min(candidates, key=lambda a: summary["arms"][a]["tokens_to_target"], default=None)
    summary["best_replay_arm"] = best
    summary["token_ratio"] = summary["time_ratio"] = summary["break_even_mu"] = None
    if best and base["tokens_to_target"]:
        b = summary["arms"][best]
        summary["token_ratio"] = b["tokens_to_target"] / base["tokens_to_target"]
        summary["time_ratio"] = b["seconds_to_target"] / base["seconds_to_target"]
        summary["break_even_mu"] = break_even_mu(base["_gen_to_target"], base["_trained_to_target"],
                                                 b["_gen_to_target"], b["_trained_to_target"])
    for a in summary["arms"].values():
        a.pop("_gen_to_target"), a.pop("_trained_to_target")

    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print_table(summary)
    plot(summary, os.path.join(args.output_dir, "curves.png"))
    return summary


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(s: dict) -> None:
    print(f"\ntarget accuracy (on-policy final median): {s['target_accuracy']:.3f};  measured mu = {s['mu']:.2f} "
          f"(generation / training seconds per rollout);  lr {s['lr_chosen_by']}: {s['lr']}")
    print(f"{'arm':<16}{'final acc':>10}{'range':>14}{'tokens->target':>16}{'sec->target':>13}{'updates':>9}"
          f"{'entropy':>9}{'gen s':>8}{'train s':>9}")
    for name, a in s["arms"].items():
        lo, hi = a["final_accuracy_range"]
        print(f"{name:<16}{a['final_accuracy']:>10.3f}{f'{lo:.2f}-{hi:.2f}':>14}{fmt(a['tokens_to_target'], ',.0f'):>16}"
              f"{fmt(a['seconds_to_target'], '.1f'):>13}{fmt(a['steps_to_target'], '.0f'):>9}{a['entropy']:>9.3f}"
              f"{a['gen_seconds']:>8.1f}{a['train_seconds']:>9.1f}")
    print(f"best replay arm: {s['best_replay_arm']};  token ratio {fmt(s['token_ratio'], '.2f')}, "
          f"time ratio {fmt(s['time_ratio'], '.2f')} (replay / on-policy, to the target);  "
          f"break-even mu {fmt(s['break_even_mu'], '.2f')} (replay pays in wall time above it)")


def plot(s: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no curves.png (pip install matplotlib); summary.json has the curves")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, a in s["arms"].items():
        c = a["curve"]
        for ax, key in zip(axes, ("tokens", "seconds")):
            line, = ax.plot(c[key], c["accuracy"], label=name, marker=".")
            ax.fill_between(c[key], c["min"], c["max"], alpha=0.15, color=line.get_color())
    for ax, label in zip(axes, ("generated completion tokens", "seconds (generation + training)")):
        ax.axhline(s["target_accuracy"], color="grey", lw=0.8, ls="--")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(title="median over seeds; band: min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"curves: {path}")


if __name__ == "__main__":
    main()
    sys.exit(0)
