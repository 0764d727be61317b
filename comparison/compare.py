"""Does replay pay off? Arms of train.py's loop under the same budget of generated tokens.

    python comparison/compare.py --output-dir runs/compare            # 3 arms x 5 seeds, two runs side by side
    python comparison/compare.py --quick --output-dir /tmp/cmp        # the pipeline in ~1 minute
    python comparison/cost.py --output cost.json           # this machine's cost of a round, then:
    python comparison/compare.py --summary runs/compare/summary.json --cost cost.json   # which arm is first here?

Arms (B = batch size, y = replay ratio, G = num_generations; every arm K = 1 update per round):
    on_policy   R = B fresh rollouts per update, N = B: each rollout used once, right away
    replay      replay in rounds: R = B/y fresh rollouts per update, N = B, same B and lr:
                each update mixes the newest R rollouts with y-1 older rounds; each rollout used y times
    control     on-policy with R = B = N = B/y: as many updates per generated token as replay,
                with no reuse; it separates "reuse" from "more, smaller updates"
  optional (--arms): replay_y3 (the replay arm with y = 3), replay_y4 and control_y4 (y = 4, N = 4R,
                and its control R = B = N = B/4), replay_y4_ppo (replay_y4 with the clipped loss),
                replay_pbr (positive-bias retention),
                replay_nonzero (only rollouts with a non-zero advantage are kept), replay_ppo (the
                clipped loss), replay_asymre (AsymRE), replay_cap1 and replay_cap4 (the replay arm
                with the importance weight truncated at C = 1 or 4 instead of 2),
                control_nonzero (replay_nonzero's filter with no reuse: each kept rollout is used
                once, an update whenever B have been kept; it separates "reuse" from "filtering")
                replay_big (the replay arm with a buffer of N = 2B: the same uses, older rollouts)
  Each replay arm's control (control_of): replay_y4 and replay_y4_ppo -> control_y4,
  replay_nonzero -> control_nonzero,
  replay_y3 -> none, every other replay arm -> control (same R and B as replay).
  replay_big is also read against replay (vs_smaller_buffer in summary.json: the buffer alone differs).
The filtered design (--skip-zero-advantage): every arm stores only the groups whose rewards differ
(the others carry no gradient) and takes its update once S new rollouts are stored (train.py
--new-per-update S; each round generates --prompts-per-round x G), so that S plays R's part and each
stored rollout is used B/S times however many groups the filter drops: on_policy S = B = N (each
used once, at age 0: dynamic sampling); replay S = B/y, N = B; replay_big S = B/y, N = 2B; control
S = B = N = B/y; replay_y4 and control_y4 alike at y = 4. Each arm's summary gives its measured uses
and ages; an on-policy arm whose rollouts were not all used once at age 0 is flagged.

Reading the runs. Every run evaluates when its generated tokens cross the same thresholds, so the
runs of an arm line up (a round that would leave one eval standing for two thresholds is refused);
an arm's curve is the mean over its replicates. Replicate i starts from warm-start seed i of the
demo model with RL seed i (--one-model: all from the shipped model, only the RL seed varies).
Smoothed accuracy at an eval = the median of it and its two neighbours. An arm *reaches* the target
at the first eval i from which its smoothed accuracy stays at or above the target until the end of
the run; the target is the on-policy arm's final accuracy, the median of its last three evals (so
it always reaches its own target), or with --target-frac f < 1 its start plus f of its gain (a
point on the rise of a curve that saturates). One lucky eval, or a lucky last one, never counts.
The crossing is then placed between eval i-1 and eval i, linearly in the smoothed accuracy s:
f = (target - s[i-1]) / (s[i] - s[i-1]), and tokens, seconds, rounds and steps to the target are
x[i-1] + f (x[i] - x[i-1]) each (not the eval grid's step). Each replicate's own reach point is kept
in summary.json, with its run (the curves at the evals), so a summary can be read again (--summary).
Reach and hold, both: every table gives the tokens (and seconds) to *hold* the target (the reach
above) and to *first reach* it (per replicate, the first raw eval at or above it, placed alike; the
mean over the replicates), and the *fall after reach* of each arm (per replicate, the target minus its lowest eval from
its first reach on, 0 if none is below; the mean over the replicates that reached): a verdict says
whether a difference in tokens comes from the rise or from holding. The evals a rise spans (from
the start to the first reach) say how finely the grid resolves it: when the fastest arm's rise
spans fewer than 5, every verdict line says the token figures are too coarse to tell. A denser grid
where the curves rise: --early-tokens T with --early-evals M puts M evals evenly up to T, then
--evals from T to the budget (the runs get --eval-at-tokens; no interval may be shorter than a
round's tokens, as one eval cannot stand for two points).

A target fixed before the runs (issue 52): --target T (e.g. 0.45, on the rise) instead of one from
on-policy's curve, the same in every draw, and --target-rule hold|first naming the primary figure
(hold: the mean curve's reach above; first: each replicate's first reach, paired). Beside either,
every summary gives each arm's mean accuracy over the tokens (the area under accuracy against
generated tokens, stats.area) and the pairs' area difference, the wall and CPU seconds to first
reach beside the tokens, and the entropy over the second half of each run's rounds
(entropy_half), each with its interval. Arms of one's own: --arm NAME FLAGS (train.py flags as
one string, e.g. an async arm's --generators 1 ...), read against more arms with --pairs A:B;
every pair stores the flags its two arms differ in ("differs"). Each arm says whether train.py's
synchronous cap can throw away what it generated (discards_possible: it stores at most the S an
update waits for); a record keeps its run's every metrics row beside it (<record>.metrics.jsonl.gz)
and counts its rounds: generated, of zero advantage, stored, discarded, empty (summary: "rounds").

Intervals: 90% bootstrap over replicates, --bootstrap draws. A draw takes replicate i of every arm
together (they start from the same model with the same seed), recomputes the target and every arm's
reach, and takes each ratio within the draw: replay against on-policy, and replay against its own
control (paired: replay i with control i), never a ratio of two intervals. not reached counts as inf.
--sweep-lr picks each arm's lr on --sweep-seeds replicates of their own (seeds 1000, ...: their own
warm starts and RL seeds), not on the reported ones; so not with --one-model, and with a real
--model only the RL seed is held out (summary.json says so). It picks by what the tables report:
the fewest tokens to hold the sweep's target (the highest on-policy target over the lrs) on the
mean curve of the sweep replicates, not reached counting as the worst, ties broken by the mean
accuracy over the evals (the area); where the area alone would pick another lr, the summary shows
both and the token ratio to on-policy on the sweep replicates at each.
Every train.py flag compare.py sets for a run (the arm's, the replicate's, the lr, the budget, the
evals) is its own to set: --train-args holding one is refused, as are unknown flags.

Time, two ways. (a) Measured: the seconds of generation + training in the runs' logs (evals
excluded; --jobs runs side by side, one thread each), to the target, with intervals, in every table.
(b) Projected on a cost curve (--cost, from comparison/cost.py on the machine of interest):
    projected seconds = rounds to target x gen(R of the arm) + steps to target x train(B of the arm),
gen and train interpolated linearly between the curve's measured sizes (a round's time is close to
a fixed cost per call plus a cost per rollout between neighbouring sizes; linear interpolation is
exact for any such affine curve, log-log only for a power law). An arm whose R or B lies outside
the curve is refused, not extrapolated. A linear curve (gen = a R, train = b B) gives times
proportional to the old one-number model, cost_ratio * generated + trained with cost_ratio = a / b
(so the same ratios between arms); a flat generation curve favours big rounds. The cost ratio
measured on the on-policy runs (generation seconds per rollout / training seconds per rollout) is
printed as a summary figure only. A curve of another model or task than the runs' is used as given
(that is the question "what would these runs cost on my card"), with a line that says so. --summary FILE [--cost FILE]: no runs; the summary's arms read
again, and which arm reaches the target first, measured and projected, by how much (paired
intervals). --records DIR: each finished run's compact record (its eval rows, entropy tail, config
and flags; no checkpoints) as DIR/<arm>/seed<i>-<key>.json, the key a hash of its flags and starting model
(so a run with other flags, another lr say, never overwrites it); a run whose record is there with the same flags
is read from it, not run again, so a comparison resumes from a folder committed to the repository.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                # the project's modules (train.py, infra/, ...)

from infra import cli  # noqa: E402
from infra import runfolder  # noqa: E402
# The comparison's parts, beside this file: records.py runs the arms and keeps their records,
# stats.py computes the figures and their intervals, summaries.py lays them out as summary.json,
# readout.py prints and draws a summary.
from readout import decide_points, plot, print_answer, print_table  # noqa: E402
from records import (ARMS, FILTERED_ARMS, FIXED_Y, NOT_PASSED, OPTIONAL_ARMS,  # noqa: E402
                     arm_flags_of, build_tiny_model, discards_possible, load_record, own_flags,
                     plain_flags, read_record, record_argv, record_path, run_record, run_train,
                     save_record, save_rows, starting_model, threads_env, token_grid,
                     train_flags, warm_start_seed)
from stats import (CompareError, bootstrap, choose_lr, figures, final_accuracy,  # noqa: E402
                   finite, load_cost, sweep_target, unit_costs)
from summaries import summarize  # noqa: E402
from stats import target_accuracy  # noqa: E402,F401  tests/test_flags.py reads it here

# Defaults of the flags whose parser default is None ("not given"): some apply only with another
# flag, some --quick changes. A flag given keeps its value.
DEFAULTS = dict(budget_tokens=450_000, seeds=5, eval_prompts=500, evals=15, bootstrap=2000, sweep_seeds=2,
                keep_correct_frac=0.3, early_evals=10)
QUICK = dict(budget_tokens=5_000, seeds=2, eval_prompts=100, evals=4, bootstrap=200)


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="compare.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="runs/compare", help="folder for the runs, summary.json and curves.png")
    p.add_argument("--budget-tokens", type=int, help="generated completion tokens per run (default 450,000)")
    p.add_argument("--seeds", type=int, help="replicates per arm (default 5; intervals need 5 or more); "
                                             "replicate i starts from warm-start seed i with RL seed i")
    p.add_argument("--first-seed", type=int, default=0,
                   help="replicate i is seed first-seed + i (seeds not used to choose any setting)")
    p.add_argument("--one-model", action="store_true",
                   help="tiny model only: every replicate starts from the default model (warm-start seed 0); only "
                        "the RL seed varies (not with --sweep-lr: its replicates would start from the reported "
                        "runs' model)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side, one torch thread each")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of each synchronous run (an async run's processes share the "
                        "machine's cores): in a wall-clock comparison, as many as an async arm's "
                        "processes, so that every arm has the same cores")
    p.add_argument("--batch-size", type=int, default=256, help="B, rollouts per update of the on-policy and replay arms")
    p.add_argument("--replay-ratio", type=int, default=2, help="y: uses of each rollout in the replay arms (>= 2)")
    p.add_argument("--num-generations", type=int, default=8, help="G, samples per prompt")
    p.add_argument("--lr", type=float, default=1e-3, help="one learning rate for every arm (unless --sweep-lr)")
    p.add_argument("--sweep-lr", type=float, nargs="+", default=None, metavar="LR",
                   help="learning rates to try per arm, on --sweep-seeds replicates of their own (not reported); "
                        "each arm then runs at the one with the fewest tokens to hold the target (ties: the "
                        "best mean accuracy over the evals)")
    p.add_argument("--sweep-seeds", type=int, help="with --sweep-lr: replicates per learning rate (default 2; "
                                                   "seeds 1000, 1001, ...: disjoint from the reported ones)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), metavar="ARM",
                   help=f"arms to run: {', '.join(ARMS + OPTIONAL_ARMS)}, or one of --arm")
    p.add_argument("--keep-correct-frac", type=float,
                   help="delta of the positive-bias retention arm (with --arms ... replay_pbr; default 0.3)")
    p.add_argument("--cost", default="", help="a cost curve (JSON of comparison/cost.py): each arm's time to the target "
                                             "projected on it, rounds x gen(R) + steps x train(B), with intervals")
    p.add_argument("--summary", default="", help="run nothing: read this summary.json of compare.py (with --cost: "
                                                "on that machine) and answer which arm reaches the target first, "
                                                "and by how much")
    p.add_argument("--records", default="", help="a folder (e.g. under docs/results/) for one compact record per "
                                                "finished run (JSON, a few KB): a run whose record is there with the "
                                                "same flags is read from it, not run again")
    p.add_argument("--bootstrap", type=int, help="bootstrap resamples for the intervals (default 2000)")
    p.add_argument("--target-frac", type=float, default=1.0,
                   help="the target: on-policy's start + this part of its gain (1: its final accuracy; 0.9 "
                        "puts it on the rise of a curve that saturates)")
    p.add_argument("--target", type=float, default=None, help=(
        "a target accuracy fixed before the runs (e.g. 0.45, on the rise), the same in every "
        "bootstrap draw, instead of one from on-policy's curve (--target-frac)"))
    p.add_argument("--target-rule", choices=("hold", "first"), default="hold", help=(
        "which reach of the target is the comparison's primary figure: hold (the arm's mean curve "
        "stays at or above it to the end) or first (each replicate's first eval at or above it, "
        "paired per replicate); the summary gives both"))
    p.add_argument("--arm", nargs=2, action="append", default=[], metavar=("NAME", "FLAGS"), help=(
        "an arm defined by its train.py flags, one string (e.g. async_replay '--generators 1 "
        "--prompts-per-round 4 --buffer-size 16 --batch-size 16 --new-per-update 8'); it must give "
        "--prompts-per-round, --buffer-size and --batch-size; a built-in arm's name redefines it; "
        "list it in --arms to run it"))
    p.add_argument("--pairs", nargs="+", default=[], metavar="ARM:REFERENCE", help=(
        "more pairs to read, paired per replicate, beside each arm against on_policy and each "
        "replay arm against its control (e.g. async_replay:async_on_policy)"))
    p.add_argument("--evals", type=int, help="eval points per run (default 15); with --early-tokens, those after it")
    p.add_argument("--early-tokens", type=int, default=0,
                   help="a denser grid early: --early-evals evals up to this many generated tokens, then --evals "
                        "to the budget (to resolve a rise the uniform grid crosses in 1-3 evals)")
    p.add_argument("--early-evals", type=int, help="evals up to --early-tokens (default 10)")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts per eval (default 500)")
    p.add_argument("--skip-zero-advantage", action="store_true",
                   help="the filtered design: every arm stores only groups whose rewards differ and updates once "
                        "S new ones are stored (S = B/y for replay, B for on-policy; see above)")
    p.add_argument("--prompts-per-round", type=int,
                   help="with --skip-zero-advantage: prompts per round in every arm (R = this x G generated; "
                        "default 4)")
    p.add_argument("--gen-shares", type=float, nargs="*", default=[0.86, 0.96], metavar="SHARE",
                   help="project each arm's time to the target at these shares of generation in an on-policy "
                        "run (a GPU's: docs/gpu.md measured 86-96%%): the on-policy runs' measured seconds per "
                        "generated and per trained rollout, training's scaled to give that share; a projection")
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
    if args.summary:            # read a summary, run nothing: main() answers with decide()
        others = [a for a in vars(args) if a not in ("summary", "cost") and getattr(args, a) != p.get_default(a)]
        if others:
            p.error(f"--summary {args.summary} with --{others[0].replace('_', '-')}: a summary is read as it "
                    "ran (its own target, arms, replicates and resamples); only --cost applies to it")
        return args
    if args.sweep_seeds is not None and not args.sweep_lr:
        p.error(f"--sweep-seeds {args.sweep_seeds}: replicates of the lr sweep; give --sweep-lr LR LR ...")
    if args.early_evals is not None and not args.early_tokens:
        p.error(f"--early-evals {args.early_evals}: the evals up to --early-tokens; give --early-tokens")
    if args.keep_correct_frac is not None and "replay_pbr" not in args.arms:
        p.error(f"--keep-correct-frac {args.keep_correct_frac}: the delta of the replay_pbr arm, which "
                "--arms does not run")
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK.get(name, default) if args.quick else default)
    if args.quick:      # one model: no warm starts to build
        args.one_model = True
    custom = dict(args.arm)
    if unknown := [a for a in args.arms if a not in ARMS + OPTIONAL_ARMS and a not in custom]:
        p.error(f"--arms {unknown[0]}: no such arm (choose from {', '.join(ARMS + OPTIONAL_ARMS)}, "
                "or define it with --arm NAME FLAGS)")
    if unused := [a for a in custom if a not in args.arms]:
        p.error(f"--arm {unused[0]}: defined but not in --arms")
    if "on_policy" not in args.arms:
        p.error("--arms must include on_policy (the reference every arm is read against)")
    for pair in args.pairs:
        arm, _, ref = pair.partition(":")
        if arm not in args.arms or ref not in args.arms or arm == ref:
            p.error(f"--pairs {pair}: must be ARM:REFERENCE, two different arms of --arms")
    if args.target is not None and not 0 < args.target < 1:
        p.error(f"--target {args.target}: an accuracy in (0, 1)")
    if args.target is not None and args.target_frac != 1.0:
        p.error(f"--target {args.target} with --target-frac {args.target_frac}: one target, fixed "
                "or from on-policy's curve")
    if args.replay_ratio < 2:
        p.error(f"--replay-ratio {args.replay_ratio}: must be >= 2")
    if args.prompts_per_round is not None and not args.skip_zero_advantage:
        p.error(f"--prompts-per-round {args.prompts_per_round}: the filtered design's (--skip-zero-advantage); "
                "the other arms' rounds follow from B, y and G")
    if args.skip_zero_advantage and args.prompts_per_round is None:
        args.prompts_per_round = 4
    builtin = [a for a in args.arms if a not in custom]
    if args.skip_zero_advantage and (wrong := [a for a in builtin if a not in FILTERED_ARMS]):
        p.error(f"--arms {wrong[0]} with --skip-zero-advantage: the filtered design has the arms "
                f"{', '.join(FILTERED_ARMS)}")
    if not all(0 < g < 1 for g in args.gen_shares):
        p.error(f"--gen-shares {args.gen_shares}: each must be in (0, 1)")
    for y in {args.replay_ratio, *(FIXED_Y[a] for a in builtin if a in FIXED_Y)}:
        if args.batch_size % (y * args.num_generations):
            p.error(f"--batch-size {args.batch_size} must be a multiple of replay ratio x num_generations "
                    f"= {y * args.num_generations}")
    if not 0 < args.target_frac <= 1:
        p.error(f"--target-frac {args.target_frac}: must be in (0, 1]")
    if args.first_seed < 0 or args.first_seed and args.sweep_lr:
        p.error("--first-seed must be >= 0, and not with --sweep-lr (its replicates are 1000, ...)")
    if args.evals < 3 or args.seeds < 1 or args.jobs < 1 or args.sweep_seeds < 1 or args.threads < 1:
        p.error("--evals must be >= 3, --seeds, --sweep-seeds, --jobs and --threads >= 1")
    if args.early_tokens and not (0 < args.early_tokens < args.budget_tokens and args.early_evals >= 1):
        p.error(f"--early-tokens {args.early_tokens}: must be in (0, --budget-tokens {args.budget_tokens}), "
                f"with --early-evals >= 1")
    if args.early_tokens and len(token_grid(args)) != args.early_evals + args.evals + 1:
        p.error(f"--early-tokens {args.early_tokens} with --early-evals {args.early_evals} and --evals "
                f"{args.evals}: at whole-token intervals that gives {len(token_grid(args)) - 1} evals, not "
                f"{args.early_evals + args.evals}; make --early-tokens a multiple of --early-evals")
    if args.sweep_lr and args.one_model and args.model == "tiny":
        p.error(f"--sweep-lr with {'--quick (one model)' if args.quick else '--one-model'}: the sweep's "
                "replicates would start from the reported runs' model, so it would not be held out")
    arm_given = {}
    for name, flags in args.arm:        # train.py's flags, R, N and B each given
        arm_given[name] = train_flags(shlex.split(flags), prog=f"compare.py --arm {name}")
        needed = ("prompts_per_round", "buffer_size", "batch_size")
        if missing := [f for f in needed if f not in arm_given[name]]:
            p.error(f"--arm {name}: give --{missing[0].replace('_', '-')} (an arm is its R, N, B)")
    # the flags of a run that are not its arm's: the replicate's, the lr, the budget, the evals
    per_run = set(train_flags(own_flags(args, "on_policy", 0, args.lr, "run"))) - set(
        train_flags(arm_flags_of(args, "on_policy")))
    for name, given in arm_given.items():
        if clash := sorted(given.keys() & (per_run | NOT_PASSED.keys())):
            p.error(f"--arm {name}: --{clash[0].replace('_', '-')} is set by compare.py for each "
                    "run (the replicate's seed and model, the lr, the budget, the evals)")
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
        return decide(args.summary, args.cost) if args.summary else compare(args)
    except CompareError as e:           # one line, as the parser's errors
        print(f"compare.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def compare(args) -> dict:
    try:        # its runs are rewritten from scratch: two comparisons in one folder would mix
        runfolder.lock_folder(args.output_dir, what="a comparison in progress")
    except runfolder.RunFolderBusy as e:
        raise CompareError(str(e)) from None
    grid = token_grid(args)
    cost = load_cost(args.cost) if args.cost else None
    sizes, G = {}, args.num_generations
    for arm in args.arms:
        flags = train_flags(arm_flags_of(args, arm))
        sizes[arm] = (flags["prompts_per_round"] * args.num_generations, flags["batch_size"])
        if discards_possible(arm_flags_of(args, arm) + ["--num-generations", str(G)]):
            print(f"note: {arm} can throw away rollouts it generated (train.py's synchronous "
                  "loop stores at most the S an update waits for): its tokens include them; "
                  "summary.json counts them where its records keep the rounds", flush=True)
    unit_costs(cost, sizes)                     # an arm outside the cost curve: refused before any run

    sweep_seeds = list(range(1000, 1000 + args.sweep_seeds)) if args.sweep_lr else []
    steps = train_flags(args.train_args).get("warm_start_steps", 0)
    first, threads = getattr(args, "first_seed", 0), getattr(args, "threads", 1)   # old summaries' args
    seeds = range(first, first + args.seeds)
    built, locks = set(), {warm_start_seed(args, s): threading.Lock() for s in [*seeds, *sweep_seeds]}
    models = {ws: starting_model(args.model, args.task, ws, steps) for ws in locks}     # what each record names

    def need_model(seed: int) -> None:
        """Each starting model built once, before the first run that needs it (none for recorded runs)."""
        if args.model != "tiny":
            return
        ws = warm_start_seed(args, seed)
        with locks[ws]:
            if ws not in built:
                build_tiny_model(args.task, ws, steps)
                built.add(ws)

    plain = plain_flags(args)

    def run(arm: str, seed: int, lr: float, tag: str = "") -> dict:
        name = os.path.join(arm + tag, f"seed{seed}")
        out = os.path.join(args.output_dir, name)
        argv = plain + own_flags(args, arm, seed, lr, out) + args.train_args
        model = models[warm_start_seed(args, seed)]
        path = args.records and record_path(args.records, name, argv, model)
        record = load_record(path, argv, model, threads) if path else None
        if record is None:
            need_model(seed)
            run_train(argv, out, threads_env(threads))
            record = {"argv": record_argv(argv), "model": model, "threads": threads,
                      **run_record(out)}
            if path:
                save_rows(path, out)            # every row, so that its rounds can be counted again
                save_record(path, record)
        return read_record(record, grid, path or out)

    start = time.time()
    lrs, sweep = {arm: args.lr for arm in args.arms}, {}
    with ThreadPoolExecutor(args.jobs) as pool:
        if args.sweep_lr:
            # replicates 1000, 1001, ...: the sweep selects on runs that are not reported (no selection bias)
            jobs = {(arm, lr, s): pool.submit(run, arm, s, lr, f"-lr{lr:g}")
                    for arm in args.arms for lr in args.sweep_lr for s in sweep_seeds}
            swept = {arm: {lr: [jobs[arm, lr, s].result() for s in sweep_seeds] for lr in args.sweep_lr}
                     for arm in args.arms}
            sweep_at = (sweep_target(swept["on_policy"], args.target_frac) if args.target is None
                        else args.target)
            for arm in ["on_policy"] + [a for a in args.arms if a != "on_policy"]:
                sweep[arm] = choose_lr(swept[arm], sweep_at)
                lrs[arm] = sweep[arm]["chosen"]
                if not sweep[arm]["rules_agree"] and arm != "on_policy":     # would the area's choice change it?
                    on = swept["on_policy"][lrs["on_policy"]]
                    sweep[arm]["sweep_token_ratio"] = {
                        f"{lr:g}": finite(figures({"on_policy": on, arm: swept[arm][lr]},
                                                  args.target_frac, target=args.target, pairs=[
                            (arm, "on_policy")])["arms"][arm]["vs"]["on_policy"]["token_ratio"])
                        for lr in (sweep[arm]["chosen"], sweep[arm]["area_choice"])}
                print(f"{arm}: lr sweep ({len(sweep_seeds)} replicates) tokens to hold {sweep_at:.3f} "
                      f"{ {f'{k:g}': v and round(v) for k, v in sweep[arm]['tokens_to_hold'].items()} } -> {lrs[arm]:g}"
                      + ("" if sweep[arm]["rules_agree"] else
                         f" (the area under the curve would choose {sweep[arm]['area_choice']:g})")
                      + (" (ON THE EDGE of the grid: widen it)" if sweep[arm]["on_grid_edge"] else ""), flush=True)
        jobs = {(arm, seed): pool.submit(run, arm, seed, lrs[arm]) for seed in seeds for arm in args.arms}
        results = {arm: [] for arm in args.arms}
        for (arm, seed), job in jobs.items():
            results[arm].append(job.result())
            print(f"{arm} seed {seed}: final accuracy {final_accuracy(results[arm][-1]['accuracy']):.3f} "
                  f"({time.time() - start:.0f} s so far)", flush=True)
    summary = summarize(results, args, grid, lrs, cost)
    held_out = ("warm-start seed and RL seed: models of their own" if args.model == "tiny" else
                f"the RL seed only: every replicate starts from {args.model}")
    summary["lr_sweep"] = sweep and {
        "seeds": sweep_seeds, "held_out": held_out, "target": sweep_at,
        "rule": "fewest tokens to hold the target (the highest on-policy target over the lrs) on the mean curve "
                "of the sweep replicates; not reached: worst; ties: the larger mean accuracy over the evals (the "
                "area), then the smaller lr",
        "area_rule": "the largest mean accuracy over the evals; where it differs, sweep_token_ratio gives the "
                     "token ratio to on_policy on the sweep replicates (points) at both choices",
        "arms": sweep}
    runfolder.write_json(os.path.join(args.output_dir, "summary.json"), summary, indent=2)
    print_table(summary)
    plot(summary, os.path.join(args.output_dir, "curves.png"))
    return summary


def print_or_run(argv: list[str], print_only: bool = False):
    """A planned comparison (compare_async.py, compare_collapse.py, ...): its compare.py command
    printed, as its page shows it; then run, unless print_only."""
    print("python comparison/compare.py " + " ".join(shlex.quote(x) for x in argv), flush=True)
    return None if print_only else main(argv)


# ---- the user's decision: which arm reaches the target first on this machine ---------------------
def decide(summary_path: str, cost_path: str = "") -> dict:
    """Which arm of a comparison reaches the target first, and by how much: measured (on the machine
    that ran it) and projected on a cost curve of this machine (the comparison's rounds and steps to
    the target, charged at this machine's seconds per round and per step). A summary with each
    replicate's runs is recomputed with intervals (paired draws); an older one gives point figures."""
    try:
        s = json.load(open(summary_path))
        s["arms"]["on_policy"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CompareError(f"--summary {summary_path}: not a summary.json of compare.py ({type(e).__name__}: {e})")
    cost = load_cost(cost_path) if cost_path else None
    if "args" in s and all("replicates" in e for e in s["arms"].values()):
        results = {arm: [{k: v for k, v in r.items() if k != "reach"} for r in e["replicates"]]
                   for arm, e in s["arms"].items()}
        args = argparse.Namespace(**s["args"])
        lr_sweep = s.get("lr_sweep")
        s = summarize(results, args, s["grid_tokens"], s["lr"], cost)
        s["lr_sweep"] = lr_sweep
        print_table(s)
        units = unit_costs(cost, {arm: (runs[0]["R"], runs[0]["B"]) for arm, runs in results.items()})
        times = {"measured": lambda a: a["seconds"], **{u: (lambda a, u=u: a["projected"][u]) for u in units}}
        answer = {}
        for basis, time_of in times.items():
            fixed = getattr(args, "target", None)
            point = figures(results, args.target_frac, units, target=fixed)["arms"]
            best = min(point, key=lambda a: time_of(point[a]))
            pairs = [(best, a) for a in point if a != best]
            fig = figures(results, args.target_frac, units, pairs, fixed)["arms"][best]["vs"]
            ci = bootstrap(results, args.bootstrap, frac=args.target_frac, units=units, pairs=pairs,
                           target=fixed)["arms"][best]["vs"]
            key = (lambda v: v["time_ratio"]) if basis == "measured" else (lambda v, u=basis: v["projected_ratio"][u])
            answer[basis] = {"fastest": best, "seconds": finite(time_of(point[best])),
                             "ratio_to": {a: [finite(key(fig[a])), *finite(key(ci[a]))] for a in fig}}
    else:
        answer = decide_points(s, cost)
    print_answer(s, answer, cost_path)
    return answer


if __name__ == "__main__":
    main()
    sys.exit(0)
