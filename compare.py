"""Does replay pay off? Arms of train.py's loop under the same budget of generated tokens.

    python compare.py --output-dir runs/compare            # 3 arms x 5 seeds, two runs side by side
    python compare.py --quick --output-dir /tmp/cmp        # the pipeline in ~1 minute

Arms (B = batch size, y = replay ratio, G = num_generations; every arm K = 1 update per round):
    on_policy   R = B fresh rollouts per update, N = B: each rollout used once, right away
    replay      the paper's form: R = B/y fresh rollouts per update, N = B, same B and lr:
                each update mixes the newest R rollouts with y-1 older rounds; each rollout used y times
    control     on-policy with R = B = N = B/y: as many updates per generated token as replay,
                with no reuse; it separates "reuse" from "more, smaller updates"
  optional (--arms): replay_y3 (the replay arm with y = 3), replay_pbr (positive-bias retention),
                replay_nonzero (only rollouts with a non-zero advantage are kept), replay_ppo (the
                clipped loss), replay_asymre (AsymRE), replay_cap1 and replay_cap4 (the replay arm
                with the importance weight truncated at C = 1 or 4 instead of 2),
                control_nonzero (replay_nonzero's filter with no reuse: each kept rollout is used
                once, an update whenever B have been kept; it separates "reuse" from "filtering")

Reading the runs. Every run evaluates when its generated tokens cross the same thresholds, so the
runs of an arm line up (a round that would leave one eval standing for two thresholds is refused);
an arm's curve is the mean over its replicates. Replicate i starts from warm-start seed i of the
demo model with RL seed i (--one-model: all from the shipped model, only the RL seed varies).
Smoothed accuracy at an eval = the median of it and its two neighbours. An arm *reaches* the target
at the first eval from which its smoothed accuracy stays at or above the target until the end of
the run; the target is the on-policy arm's final accuracy, the median of its last three evals (so
it always reaches its own target), or with --target-frac f < 1 its start plus f of its gain (a
point on the rise of a curve that saturates). One lucky eval, or a lucky last one, never counts.
Intervals: 90% bootstrap over replicates, each arm's replicate drawn with on-policy's replicate of
the same model (pairs), the target recomputed, --bootstrap times. --sweep-lr picks each arm's lr on
--sweep-seeds replicates of their own (seeds 1000, ...: their own warm starts and RL seeds), not on
the reported ones; so not with --one-model, and with a real --model only the RL seed is held out
(summary.json says so).
Every train.py flag compare.py sets for a run (the arm's, the replicate's, the lr, the budget, the
evals) is its own to set: --train-args holding one is refused, as are unknown flags.

Cost model. Let mu = (generation seconds per rollout) / (training seconds per rollout). In units
of one training rollout, a run costs mu * (rollouts generated) + (rollouts trained). Replay saves
generated rollouts but adds trained ones, so it pays in wall time only when mu > break-even =
(extra trained rollouts) / (saved generated rollouts), both counted up to the target. --mu projects
each arm's time to the target at other costs of generation (a GPU's: 8-27) from the runs' counts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import cli
import train

ROOT = os.path.dirname(os.path.abspath(__file__))
ARMS = ("on_policy", "replay", "control")
OPTIONAL_ARMS = ("replay_y3", "replay_pbr", "replay_nonzero", "replay_ppo", "replay_asymre", "replay_cap1",
                 "replay_cap4", "control_nonzero")
GPU_MU = (8.0, 27.0)            # measured on a lent H200, 0.5B-shaped model (train.py runs / bench.py)


def arm_flags(arm: str, batch: int, y: int, G: int, delta: float) -> list[str]:
    """train.py flags that define an arm: prompts per round P (R = P*G), buffer N, batch B, extras."""
    if arm == "on_policy":
        P, N, B = batch // G, batch, batch
    elif arm == "control":
        P, N, B = batch // (y * G), batch // y, batch // y
    elif arm == "replay_y3":                # replay with each rollout used 3 times, whatever --replay-ratio
        P, N, B = batch // (3 * G), batch, batch
    elif arm == "control_nonzero":          # a queue of kept rollouts, each used once: no eviction before use
        P, N, B = batch // (y * G), batch + batch // y, batch
    else:
        P, N, B = batch // (y * G), batch, batch
    extra = {"replay_pbr": ["--keep-correct-frac", str(delta)], "replay_nonzero": ["--skip-zero-advantage"],
             "replay_ppo": ["--loss", "ppo"], "replay_asymre": ["--loss", "asymre"],
             "replay_cap1": ["--is-cap", "1.0"], "replay_cap4": ["--is-cap", "4.0"],
             "control_nonzero": ["--skip-zero-advantage", "--no-reuse"]}.get(arm, [])
    return ["--prompts-per-round", str(P), "--buffer-size", str(N), "--batch-size", str(B)] + extra


class CompareError(ValueError):
    """A setting or a run that the comparison cannot use; the message says what to change."""


# ---- one run, read back ------------------------------------------------------------------
def read_run(run_dir: str, grid: list[float]) -> dict:
    """A run's evals at the grid of token thresholds (at each g: its first eval with generated
    tokens >= g), with the exact counts of rollouts generated (rounds x R) and trained (steps x B)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    R, B = cfg["prompts_per_round"] * cfg["num_generations"], cfg["batch_size"]
    steps = [r for r in rows if "eval_accuracy" not in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    picks = [next(r for r in evals if r["gen_tokens"] >= g) for g in grid]
    for a, b, g in zip(picks, picks[1:], grid[1:]):
        if a is b:      # one eval would count twice in the smoothing (a lucky one could set the target)
            raise CompareError(f"{run_dir}: the eval at {a['gen_tokens']:,} tokens stands for the grid points "
                               f"below and at {g:,}: one round generated more tokens than the eval interval "
                               f"({grid[1] - grid[0]:,}); raise --budget-tokens or lower --evals")
    tail = steps[-max(1, len(steps) // 20):]             # entropy: mean over the last 5% of steps
    last = rows[-1]                                      # every line carries the cumulative counters
    return {
        "tokens": [r["gen_tokens"] for r in picks],
        "seconds": [r["gen_seconds"] + r["train_seconds"] for r in picks],
        "generated": [r["round"] * R for r in picks],
        "trained": [r["step"] * B for r in picks],
        "accuracy": [r["eval_accuracy"] for r in picks],
        "entropy": statistics.mean(r["rollout_entropy"] for r in tail) if tail else float("nan"),
        "gen_seconds": last["gen_seconds"], "train_seconds": last["train_seconds"],
        "rollouts_generated": last["round"] * R, "rollouts_trained": last["step"] * B,
    }


# ---- reaching the target -------------------------------------------------------------------
def final_accuracy(accs: list[float]) -> float:
    """The median of the last three evals: one lucky or unlucky last eval does not decide it."""
    return statistics.median(accs[-3:])


def reach_index(accs: list[float], target: float) -> int | None:
    """Index of the first eval from which the smoothed accuracy (median of the eval and its two
    neighbours) stays >= target to the end of the run; None if it never does. Only evals with two
    neighbours are smoothed, so the last one counts only within the median of the last three."""
    held = None
    for i in range(len(accs) - 2, 0, -1):                # from the last smoothed point backwards
        if statistics.median(accs[i - 1:i + 2]) < target - 1e-9:
            break
        held = i
    return held


def mean_curve(runs: list[dict]) -> dict[str, list[float]]:
    keys = ("tokens", "seconds", "generated", "trained", "accuracy")
    return {k: [statistics.fmean(r[k][j] for r in runs) for j in range(len(runs[0][k]))] for k in keys}


def to_target(runs: list[dict], target: float) -> dict | None:
    """Tokens, seconds, generated and trained rollouts at the arm's reach of the target (mean curve)."""
    curve = mean_curve(runs)
    i = reach_index(curve["accuracy"], target)
    return None if i is None else {k: curve[k][i] for k in ("tokens", "seconds", "generated", "trained")}


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


def projected_cost(point: dict, mu: float) -> float:
    """Time to the target in units of one trained rollout, at generation cost mu."""
    return mu * point["generated"] + point["trained"]


def target_accuracy(on: list[dict], frac: float = 1.0) -> float:
    """The accuracy to reach: the on-policy arm's start plus frac of its gain to its final accuracy
    (frac 1: the final accuracy itself; below 1, a point on the rise of a curve that saturates,
    where "tokens to the plateau" would be decided by the plateau's noise)."""
    accs = mean_curve(on)["accuracy"]
    final = final_accuracy(accs)
    return min(accs[0] + frac * (final - accs[0]), final)     # a falling curve: its final accuracy


def compare_arm(arm: list[dict], on: list[dict], mus: list[float], frac: float = 1.0) -> dict:
    """Point figures of one arm against on_policy: token ratio, measured time ratio, projected
    time ratios at each mu, final accuracy and entropy differences (inf: the arm did not reach)."""
    target = target_accuracy(on, frac)
    a, o = to_target(arm, target), to_target(on, target)
    ratio = (lambda k: a[k] / o[k]) if a else (lambda k: math.inf)
    return {"token_ratio": ratio("tokens"), "time_ratio": ratio("seconds"),
            "projected": {mu: (projected_cost(a, mu) / projected_cost(o, mu)) if a else math.inf for mu in mus},
            "accuracy_diff": (final_accuracy(mean_curve(arm)["accuracy"])
                              - final_accuracy(mean_curve(on)["accuracy"])),
            "entropy_diff": statistics.fmean(r["entropy"] for r in arm) - statistics.fmean(r["entropy"] for r in on)}


def bootstrap(arm: list[dict], on: list[dict], mus: list[float], n: int, seed: int = 0,
              frac: float = 1.0) -> dict:
    """90% percentile intervals of compare_arm's figures, resampling replicates with replacement.
    Replicate i of the arm and of on_policy start from the same model and seed, so they are drawn
    together (pairs): the interval covers the spread across starting models, not only RL seeds."""
    rng = random.Random(seed)
    pairs = list(zip(arm, on))

    def draw() -> dict:
        sample = rng.choices(pairs, k=len(pairs))
        return compare_arm([a for a, _ in sample], [o for _, o in sample], mus, frac)
    draws = [draw() for _ in range(n)]

    def interval(values: list[float]) -> list[float]:
        values = sorted(values)
        return [values[int(0.05 * (n - 1))], values[int(math.ceil(0.95 * (n - 1)))]]
    out = {k: interval([d[k] for d in draws]) for k in ("token_ratio", "time_ratio", "accuracy_diff", "entropy_diff")}
    out["projected"] = {mu: interval([d["projected"][mu] for d in draws]) for mu in mus}
    out["not_reached_frac"] = sum(math.isinf(d["token_ratio"]) for d in draws) / n
    return out


def choose_lr(scores: dict[float, list[float]]) -> tuple[float, dict[float, float], bool]:
    """The learning rate with the best mean score over the sweep's replicates (ties: the smaller lr),
    the mean of each candidate, and whether the choice lies on the edge of the grid (then the grid
    should be widened: the best may lie outside it)."""
    means = {lr: statistics.fmean(v) for lr, v in sorted(scores.items())}
    best = max(means, key=lambda lr: (means[lr], -lr))
    return best, means, len(means) > 1 and best in (min(means), max(means))


def sweep_score(run: dict) -> float:
    """A sweep's score of one run: its mean accuracy over the evals (the area under its accuracy
    against generated tokens), which rewards learning fast and holding it, not one final eval."""
    return statistics.fmean(run["accuracy"])


def verdict(ratio_interval: list[float], diff_interval: list[float]) -> str:
    """Plain words for the token ratio and the accuracy difference against on-policy."""
    lo, hi = ratio_interval
    tokens = ("fewer tokens" if hi < 1 else "more tokens" if lo > 1 else "tokens within noise")
    lo, hi = diff_interval
    acc = ("higher final accuracy" if lo > 0 else "lower final accuracy" if hi < 0 else "final accuracy within noise")
    return f"{tokens}; {acc}"


# ---- running the arms ----------------------------------------------------------------------
def build_tiny_model(task: str, warm_start_seed: int, warm_start_steps: int = 0) -> None:
    """The embedded model of one warm start (demo.py), built and cached in a process of its own, one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "demo.py", "--task", task, "--warm-start-seed", str(warm_start_seed),
                    "--warm-start-steps", str(warm_start_steps)], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)


def run_train(argv: list[str], out: str) -> None:
    """One train.py run in its own process, one torch thread (runs side by side do not fight for
    cores). A finished run (done.json with the same flags) is not run again: an interrupted
    comparison picks up where it stopped."""
    done = os.path.join(out, "done.json")
    if os.path.exists(done) and json.load(open(done)) == argv:
        return
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(os.path.join(out, "log.txt"), "w") as log:
        code = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = open(os.path.join(out, "log.txt")).read().strip().splitlines()[-3:]
        raise RuntimeError(f"train.py {' '.join(argv)} exited with {code}: {' / '.join(tail)}")
    with open(done, "w") as f:
        json.dump(argv, f)


# Defaults of the flags whose parser default is None ("not given"): some apply only with another
# flag, some --quick changes. A flag given keeps its value.
DEFAULTS = dict(budget_tokens=450_000, seeds=5, eval_prompts=500, evals=15, bootstrap=2000, sweep_seeds=2,
                keep_correct_frac=0.3)
QUICK = dict(budget_tokens=5_000, seeds=2, eval_prompts=100, evals=4, bootstrap=200)
# train.py flags that --train-args may not hold although compare.py does not set them: why
NOT_PASSED = {"resume": "compare.py starts its own runs",
              "eval_every": "the runs evaluate at token thresholds instead (--evals)"}


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="compare.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="runs/compare", help="folder for the runs, summary.json and curves.png")
    p.add_argument("--budget-tokens", type=int, help="generated completion tokens per run (default 450,000)")
    p.add_argument("--seeds", type=int, help="replicates per arm (default 5; intervals need 5 or more); "
                                             "replicate i starts from warm-start seed i with RL seed i")
    p.add_argument("--one-model", action="store_true",
                   help="every replicate starts from the default model (warm-start seed 0); only the RL seed "
                        "varies (not with --sweep-lr: its replicates would start from the reported runs' model)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side, one torch thread each")
    p.add_argument("--batch-size", type=int, default=256, help="B, rollouts per update of the on-policy and replay arms")
    p.add_argument("--replay-ratio", type=int, default=2, help="y: uses of each rollout in the replay arms (>= 2)")
    p.add_argument("--num-generations", type=int, default=8, help="G, samples per prompt")
    p.add_argument("--lr", type=float, default=1e-3, help="one learning rate for every arm (unless --sweep-lr)")
    p.add_argument("--sweep-lr", type=float, nargs="+", default=None, metavar="LR",
                   help="learning rates to try per arm, on --sweep-seeds replicates of their own (not reported); "
                        "each arm then runs at the one with the best mean accuracy over the evals")
    p.add_argument("--sweep-seeds", type=int, help="with --sweep-lr: replicates per learning rate (default 2; "
                                                   "seeds 1000, 1001, ...: disjoint from the reported ones)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS + OPTIONAL_ARMS, help="arms to run")
    p.add_argument("--keep-correct-frac", type=float,
                   help="delta of the positive-bias retention arm (with --arms ... replay_pbr; default 0.3)")
    p.add_argument("--mu", type=float, nargs="+", default=None,
                   help="costs of generation (seconds per generated / per trained rollout) to project each arm's "
                        f"time to the target at; default: this machine's measured mu and {GPU_MU[0]:g}, {GPU_MU[1]:g}")
    p.add_argument("--bootstrap", type=int, help="bootstrap resamples for the intervals (default 2000)")
    p.add_argument("--target-frac", type=float, default=1.0,
                   help="the target: on-policy's start + this part of its gain (1: its final accuracy; 0.9 "
                        "puts it on the rise of a curve that saturates)")
    p.add_argument("--evals", type=int, help="eval points per run (default 15)")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts per eval (default 500)")
    p.add_argument("--model", default="tiny", help="passed to train.py")
    p.add_argument("--task", default="addition", help="passed to train.py")
    p.add_argument("--quick", action="store_true",
                   help="5k tokens, 2 seeds of one model, 4 evals of 100 prompts, 200 resamples (unless given): "
                        "checks the pipeline")
    p.add_argument("--train-args", default="", help="more train.py flags for every run, as one string; not "
                                                    "those compare.py sets itself (it refuses them)")
    return p


def parse(argv=None) -> argparse.Namespace:
    """The comparison's settings, checked: a flag that cannot do what it says stops here, in one
    line, before any model is built or run."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.sweep_seeds is not None and not args.sweep_lr:
        p.error(f"--sweep-seeds {args.sweep_seeds}: replicates of the lr sweep; give --sweep-lr LR LR ...")
    if args.keep_correct_frac is not None and "replay_pbr" not in args.arms:
        p.error(f"--keep-correct-frac {args.keep_correct_frac}: the delta of the replay_pbr arm, which "
                "--arms does not run")
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK.get(name, default) if args.quick else default)
    if args.quick:      # one model: no warm starts to build
        args.one_model = True
    if "on_policy" not in args.arms:
        p.error("--arms must include on_policy (it sets the target)")
    if args.replay_ratio < 2:
        p.error(f"--replay-ratio {args.replay_ratio}: must be >= 2")
    for y in {args.replay_ratio, *([3] if "replay_y3" in args.arms else [])}:
        if args.batch_size % (y * args.num_generations):
            p.error(f"--batch-size {args.batch_size} must be a multiple of replay ratio x num_generations "
                    f"= {y * args.num_generations}")
    if not 0 < args.target_frac <= 1:
        p.error(f"--target-frac {args.target_frac}: must be in (0, 1]")
    if args.evals < 3 or args.seeds < 1 or args.jobs < 1 or args.sweep_seeds < 1:
        p.error("--evals must be >= 3, --seeds, --sweep-seeds and --jobs >= 1")
    if args.sweep_lr and args.one_model and args.model == "tiny":
        p.error(f"--sweep-lr with {'--quick (one model)' if args.quick else '--one-model'}: the sweep's "
                "replicates would start from the reported runs' model, so it would not be held out")
    args.train_args = shlex.split(args.train_args)
    given = train_flags(args.train_args)
    own = {k for arm in args.arms for k in train_flags(own_flags(args, arm, 0, args.lr, "run"))}
    if clash := [k for k in given if k in own]:
        p.error(f"--train-args {', '.join('--' + k.replace('_', '-') for k in clash)}: set by compare.py "
                "for each run (the arm's R, N, B and loss, the replicate's model and seed, the lr, the budget, "
                "the evals); use compare.py's own flags")
    for k in given.keys() & NOT_PASSED.keys():
        p.error(f"--train-args --{k.replace('_', '-')}: {NOT_PASSED[k]}")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    try:
        return compare(args)
    except CompareError as e:           # one line, as the parser's errors
        print(f"compare.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def train_flags(argv: list[str]) -> dict:
    """train.py's flags among argv, read by train.py's own parser: {field: value} of those given.
    A flag train.py does not have, or a bad value, stops here in one line."""
    parser = cli.build_parser(train.Config, explicit_only=True)
    parser.prog = "compare.py --train-args"
    return vars(parser.parse_args(argv))


def warm_start_seed(args, seed: int) -> int:
    return 0 if args.one_model else seed


def token_grid(args) -> list[int]:
    """The generated-token thresholds every run evaluates at: 0, one interval, ..., the budget."""
    interval = -(-args.budget_tokens // args.evals)                   # ceil: the last threshold is the budget
    return [k * interval for k in range(args.evals)] + [args.budget_tokens]


def own_flags(args, arm: str, seed: int, lr: float, out: str) -> list[str]:
    """The train.py flags compare.py sets for one run (replicate seed of an arm at lr): the arm's,
    the replicate's model and seed, the lr, the budget and the eval grid. A run gets these, then
    --train-args, which may hold none of them (parse refuses it)."""
    model = ["--warm-start-seed", str(warm_start_seed(args, seed))] if args.model == "tiny" else []
    # Every run evaluates when its generated tokens cross the same thresholds: curves line up.
    return arm_flags(arm, args.batch_size, args.replay_ratio, args.num_generations, args.keep_correct_frac) + model + [
        "--seed", str(seed), "--lr", str(lr), "--output-dir", out, "--model", args.model, "--task", args.task,
        "--num-generations", str(args.num_generations), "--max-gen-tokens", str(args.budget_tokens),
        "--max-rounds", str(10**9), "--eval-every-tokens", str(token_grid(args)[1]),
        "--eval-prompts", str(args.eval_prompts), "--no-progress"]


def compare(args) -> dict:
    os.makedirs(args.output_dir, exist_ok=True)
    grid = token_grid(args)

    def run(arm: str, seed: int, lr: float, tag: str = "") -> dict:
        out = os.path.join(args.output_dir, arm + tag, f"seed{seed}")
        run_train(own_flags(args, arm, seed, lr, out) + args.train_args, out)
        return read_run(out, grid)

    start = time.time()
    lrs, sweep = {arm: args.lr for arm in args.arms}, {}
    sweep_seeds = list(range(1000, 1000 + args.sweep_seeds)) if args.sweep_lr else []
    with ThreadPoolExecutor(args.jobs) as pool:
        if args.model == "tiny":        # each starting model built once, before the runs that share it
            steps = train_flags(args.train_args).get("warm_start_steps", 0)
            seeds = sorted({warm_start_seed(args, s) for s in [*range(args.seeds), *sweep_seeds]})
            list(pool.map(lambda s: build_tiny_model(args.task, s, steps), seeds))
        if args.sweep_lr:
            # replicates 1000, 1001, ...: the sweep selects on runs that are not reported (no selection bias)
            jobs = {(arm, lr, s): pool.submit(run, arm, s, lr, f"-lr{lr:g}")
                    for arm in args.arms for lr in args.sweep_lr for s in sweep_seeds}
            for arm in args.arms:
                scores = {lr: [sweep_score(jobs[arm, lr, s].result()) for s in sweep_seeds] for lr in args.sweep_lr}
                lrs[arm], means, edge = choose_lr(scores)
                sweep[arm] = {"chosen": lrs[arm], "mean_score": means, "on_grid_edge": edge}
                print(f"{arm}: lr sweep (mean accuracy over the evals, {len(sweep_seeds)} replicates) "
                      f"{ {f'{k:g}': round(v, 3) for k, v in means.items()} } -> {lrs[arm]:g}"
                      + (" (ON THE EDGE of the grid: widen it)" if edge else ""), flush=True)
        jobs = {(arm, seed): pool.submit(run, arm, seed, lrs[arm]) for seed in range(args.seeds) for arm in args.arms}
        results = {arm: [] for arm in args.arms}
        for (arm, seed), job in jobs.items():
            results[arm].append(job.result())
            print(f"{arm} seed {seed}: final accuracy {final_accuracy(results[arm][-1]['accuracy']):.3f} "
                  f"({time.time() - start:.0f} s so far)", flush=True)
    summary = summarize(results, args, grid, lrs)
    held_out = ("warm-start seed and RL seed: models of their own" if args.model == "tiny" else
                f"the RL seed only: every replicate starts from {args.model}")
    summary["lr_sweep"] = sweep and {"seeds": sweep_seeds, "held_out": held_out,
                                     "score": "mean accuracy over the evals", "arms": sweep}
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print_table(summary)
    plot(summary, os.path.join(args.output_dir, "curves.png"))
    return summary


def summarize(results: dict[str, list[dict]], args, grid: list[float], lrs: dict) -> dict:
    op = results["on_policy"]
    # mu, measured on the on-policy arm: seconds per generated rollout / seconds per trained rollout.
    mu = statistics.median((r["gen_seconds"] / r["rollouts_generated"]) / (r["train_seconds"] / r["rollouts_trained"])
                           for r in op)
    mus = [round(m, 3) for m in (args.mu if args.mu else [mu, *GPU_MU])]
    target = target_accuracy(op, args.target_frac)
    if args.model == "tiny" and not args.one_model:
        replicates = "warm-start seed i and RL seed i: the model varies"
    else:
        replicates = f"one model ({'tiny, warm-start seed 0' if args.model == 'tiny' else args.model}), RL seed i"
    summary = {"target_accuracy": target, "target_frac": args.target_frac, "mu": mu, "projected_at_mu": mus, "budget_tokens": args.budget_tokens,
               "grid_tokens": grid, "lr": lrs, "lr_chosen_by": "sweep" if args.sweep_lr else "given",
               "seconds_measured": f"generation + training (evals excluded), {args.jobs} run(s) side by side, "
                                   "one torch thread each",
               "reach_rule": "first eval from which the median of each eval and its two neighbours stays >= target",
               "replicates": replicates,
               "intervals": f"90% bootstrap over replicates, arm and on-policy drawn in pairs ({args.bootstrap} "
                            "resamples)", "arms": {}}
    base = to_target(op, target)
    for name, runs in results.items():
        point = to_target(runs, target)
        curve = mean_curve(runs)
        accs = [r["accuracy"] for r in runs]
        entry = {
            "final_accuracy": final_accuracy(curve["accuracy"]),
            "final_accuracy_range": [min(final_accuracy(a) for a in accs), max(final_accuracy(a) for a in accs)],
            "tokens_to_target": point and point["tokens"], "seconds_to_target": point and point["seconds"],
            "generated_to_target": point and point["generated"], "trained_to_target": point and point["trained"],
            "entropy": statistics.fmean(r["entropy"] for r in runs), "seeds": len(runs),
            "gen_seconds": statistics.fmean(r["gen_seconds"] for r in runs),
            "train_seconds": statistics.fmean(r["train_seconds"] for r in runs),
            "flags": " ".join(arm_flags(name, args.batch_size, args.replay_ratio, args.num_generations,
                                        args.keep_correct_frac)),
            "curve": {**curve, "min": [min(a[j] for a in accs) for j in range(len(grid))],
                      "max": [max(a[j] for a in accs) for j in range(len(grid))]},
        }
        if name != "on_policy":
            fig = compare_arm(runs, op, mus, args.target_frac)
            ci = bootstrap(runs, op, mus, args.bootstrap, frac=args.target_frac)
            finite = lambda x: None if math.isinf(x) else x                      # JSON has no inf
            entry.update({
                "token_ratio": finite(fig["token_ratio"]), "token_ratio_ci": [finite(x) for x in ci["token_ratio"]],
                "time_ratio": finite(fig["time_ratio"]), "time_ratio_ci": [finite(x) for x in ci["time_ratio"]],
                "projected_time_ratio": {f"{m:g}": {"ratio": finite(fig["projected"][m]),
                                                    "ci": [finite(x) for x in ci["projected"][m]]} for m in mus},
                "accuracy_diff": fig["accuracy_diff"], "accuracy_diff_ci": ci["accuracy_diff"],
                "entropy_diff": fig["entropy_diff"], "entropy_diff_ci": ci["entropy_diff"],
                "not_reached_frac": ci["not_reached_frac"],
                "break_even_mu": point and break_even_mu(base["generated"], base["trained"], point["generated"],
                                                         point["trained"]),
                "verdict": verdict(ci["token_ratio"], ci["accuracy_diff"]),
            })
        summary["arms"][name] = entry
    others = {a: e for a, e in summary["arms"].items() if not a.startswith(("on_policy", "control"))}
    reached = {a: e for a, e in others.items() if e["token_ratio"] is not None}
    best = min(reached, key=lambda a: reached[a]["token_ratio"], default=None)
    summary["best_replay_arm"] = best
    for key in ("token_ratio", "time_ratio", "break_even_mu", "projected_time_ratio"):
        summary[key] = summary["arms"][best][key] if best else None
    return summary


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def fmt_ci(value, ci, spec=".2f"):
    lo, hi = ci
    return f"{fmt(value, spec)} [{fmt(lo, spec)}, {'not reached' if hi is None else format(hi, spec)}]"


def print_table(s: dict) -> None:
    rule = ("on-policy final, median of its last 3 evals" if s.get("target_frac", 1.0) == 1.0 else
            f"on-policy start + {s['target_frac']:g} of its gain to its final accuracy")
    print(f"\ntarget accuracy ({rule}): {s['target_accuracy']:.3f};  measured "
          f"mu = {s['mu']:.2f} (generation / training seconds per rollout);  lr {s['lr_chosen_by']}: {s['lr']}")
    print(f"replicates: {s['replicates']}")
    for arm, sw in (s.get("lr_sweep") or {}).get("arms", {}).items():
        means = ", ".join(f"{lr:g}: {v:.3f}" for lr, v in sw["mean_score"].items())
        print(f"lr sweep {arm}: {means} -> {sw['chosen']:g}" + (" (on the edge of the grid)" if sw["on_grid_edge"] else ""))
    print(f"{'arm':<16}{'final acc':>10}{'range':>12}{'tokens->target':>16}{'sec->target':>13}"
          f"{'entropy':>9}{'gen s':>8}{'train s':>9}")
    for name, a in s["arms"].items():
        lo, hi = a["final_accuracy_range"]
        print(f"{name:<16}{a['final_accuracy']:>10.3f}{f'{lo:.2f}-{hi:.2f}':>12}{fmt(a['tokens_to_target'], ',.0f'):>16}"
              f"{fmt(a['seconds_to_target'], '.1f'):>13}{a['entropy']:>9.3f}{a['gen_seconds']:>8.1f}"
              f"{a['train_seconds']:>9.1f}")
    print("\nagainst on_policy, point [90% interval over seeds]; time ratios at mu other than the measured one are "
          "PROJECTIONS from the runs' counts of generated and trained rollouts")
    for name, a in s["arms"].items():
        if name == "on_policy":
            continue
        proj = ", ".join(f"mu {m}: {fmt_ci(v['ratio'], v['ci'])}" for m, v in a["projected_time_ratio"].items())
        print(f"{name}: tokens to target x{fmt_ci(a['token_ratio'], a['token_ratio_ci'])}; measured time "
              f"x{fmt_ci(a['time_ratio'], a['time_ratio_ci'])}; projected time {proj}; final accuracy "
              f"{fmt_ci(a['accuracy_diff'], a['accuracy_diff_ci'], '+.3f')}; entropy "
              f"{fmt_ci(a['entropy_diff'], a['entropy_diff_ci'], '+.3f')}; break-even mu "
              f"{fmt(a['break_even_mu'], '.2f')} -> {a['verdict']}")
    print(f"best replay arm: {s['best_replay_arm']}")


def plot(s: dict, path: str) -> None:
    """curves.png: each arm's accuracy against tokens, seconds and a projected cost (drawn by plot.py)."""
    from plot import plot_arms      # here, not at the top: this function's name would shadow the module
    if plot_arms(s, path) is not None:
        print(f"curves: {path}")


if __name__ == "__main__":
    main()
    sys.exit(0)
