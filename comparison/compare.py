"""Does replay pay off? Arms of train.py's loop under the same budget of generated tokens.

    python comparison/compare.py --output-dir runs/compare            # 3 arms x 5 seeds, two runs side by side
    python comparison/compare.py --quick --output-dir /tmp/cmp        # the pipeline in ~1 minute
    python comparison/cost.py --output cost.json           # this machine's cost of a round, then:
    python comparison/compare.py --summary runs/compare/summary.json --cost cost.json   # which arm is first here?

Arms (B = batch size, y = replay ratio, G = num_generations; every arm K = 1 update per round):
    on_policy   R = B fresh rollouts per update, N = B: each rollout used once, right away
    replay      the paper's form: R = B/y fresh rollouts per update, N = B, same B and lr:
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
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                # the project's modules (train.py, cli.py, ...)

import checkpoint  # noqa: E402
import cli  # noqa: E402
import train  # noqa: E402
ARMS = ("on_policy", "replay", "control")
OPTIONAL_ARMS = ("replay_big", "replay_y3", "replay_y4", "control_y4", "replay_y4_ppo", "replay_pbr", "replay_nonzero",
                 "replay_ppo", "replay_asymre", "replay_cap1", "replay_cap4", "control_nonzero")
FIXED_Y = {"replay_y3": 3, "replay_y4": 4, "control_y4": 4, "replay_y4_ppo": 4}     # arms whose y is their own, whatever --replay-ratio
# --skip-zero-advantage: the arms of the filtered design (S = new stored rollouts per update)
FILTERED_ARMS = ("on_policy", "replay", "replay_big", "control", "replay_y4", "control_y4")


def arm_flags(arm: str, batch: int, y: int, G: int, delta: float, filtered_prompts: int = 0) -> list[str]:
    """train.py flags that define an arm: prompts per round P (R = P*G), buffer N, batch B, extras.
    filtered_prompts P > 0: every arm stores only groups whose rewards differ and updates once S new
    ones are stored (train.py --new-per-update), each round P prompts: S takes R's place below."""
    y = FIXED_Y.get(arm, y)
    if filtered_prompts:
        if arm not in FILTERED_ARMS:
            raise CompareError(f"arm {arm}: not an arm of the filtered design ({', '.join(FILTERED_ARMS)})")
        S, N, B = {"on_policy": (batch, batch, batch), "replay_big": (batch // y, 2 * batch, batch),
                   "control": (batch // y,) * 3, "control_y4": (batch // y,) * 3}.get(arm, (batch // y, batch, batch))
        return ["--prompts-per-round", str(filtered_prompts), "--buffer-size", str(N), "--batch-size", str(B),
                "--skip-zero-advantage", "--new-per-update", str(S)]
    if arm == "on_policy":
        P, N, B = batch // G, batch, batch
    elif arm in ("control", "control_y4"):
        P, N, B = batch // (y * G), batch // y, batch // y
    elif arm == "control_nonzero":          # a queue of kept rollouts, each used once: no eviction before use
        P, N, B = batch // (y * G), batch + batch // y, batch
    else:
        P, N, B = batch // (y * G), 2 * batch if arm == "replay_big" else batch, batch
    extra = {"replay_pbr": ["--keep-correct-frac", str(delta)], "replay_nonzero": ["--skip-zero-advantage"],
             "replay_ppo": ["--loss", "ppo"], "replay_y4_ppo": ["--loss", "ppo"], "replay_asymre": ["--loss", "asymre"],
             "replay_cap1": ["--is-cap", "1.0"], "replay_cap4": ["--is-cap", "4.0"],
             "control_nonzero": ["--skip-zero-advantage", "--no-reuse"]}.get(arm, [])
    return ["--prompts-per-round", str(P), "--buffer-size", str(N), "--batch-size", str(B)] + extra


class CompareError(ValueError):
    """A setting or a run that the comparison cannot use; the message says what to change."""


# ---- one run, read back ------------------------------------------------------------------
X_KEYS = ("tokens", "seconds", "cpu_seconds", "rounds", "steps")          # where a run is, at an eval
EVAL_KEYS = ("round", "step", "gen_tokens", "gen_seconds", "train_seconds", "eval_accuracy")
CPU_KEYS = ("gen_cpu_seconds", "train_cpu_seconds")    # records since 2026-12-02: CPU seconds too
PER_STEP = ("is_ratio_mean", "is_ratio_max", "is_truncated_frac")        # kept per update in a run's record


def run_record(run_dir: str) -> dict:
    """The compact record of a finished run (a few KB): its config, its eval rows, the entropy of its
    last 5% of steps, its staleness over all steps (the importance weights truncated, the ages, the
    importance ratios) and per step (PER_STEP), and its final counters; all that read_record needs,
    none of its checkpoints."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    steps = [r for r in rows if "eval_accuracy" not in r and r.get("updates") != 0]   # nor rounds with none
    if not steps:
        raise CompareError(f"{run_dir}: the run took no optimizer step (its metrics.jsonl has no step row): "
                           "raise the budget, or lower B or S")
    tail = steps[-max(1, len(steps) // 20):]                # entropy: the last 5% of steps
    return {"config": cfg, "evals": [{k: r[k] for k in EVAL_KEYS + CPU_KEYS if k in r}
                                     for r in rows if "eval_accuracy" in r],
            "entropy_tail": [r["rollout_entropy"] for r in tail],
            "staleness": {"truncated_frac": statistics.fmean(r["is_truncated_frac"] for r in steps),
                          "truncated_frac_max": max(r["is_truncated_frac"] for r in steps),
                          "age_mean": statistics.fmean(r["age_mean"] for r in steps),
                          "age_max": max(r["age_max"] for r in steps),
                          "is_ratio_mean": statistics.fmean(r["is_ratio_mean"] for r in steps),
                          "is_ratio_max": max(r["is_ratio_max"] for r in steps)},
            # every update's staleness (skipped ones included), so any sentence about it can be recomputed
            "per_step": {k: [round(r[k], 5) for r in steps] for k in PER_STEP},
            "last": {k: rows[-1][k] for k in ("round", "step", "gen_seconds", "train_seconds")},
            # the measured replay: rollouts generated, stored, trained on; those gone from the buffer by
            # their uses; the ages at which they were trained (runs before these counts: absent)
            **({"reuse": {**{k: rows[-1][k] for k in ("rollouts_generated", "rollouts_stored", "rollouts_trained")},
                          "left_by_uses": next(r["left_by_uses"] for r in reversed(rows) if "left_by_uses" in r),
                          "age_mean": statistics.fmean(r["age_mean"] for r in steps),
                          "age_max": max(r["age_max"] for r in steps)}} if "rollouts_stored" in rows[-1] else {})}


def read_record(record: dict, grid: list[float], name: str = "run") -> dict:
    """A run's evals at the grid of token thresholds (at each g: its first eval with generated tokens
    >= g): accuracy, tokens, seconds (generation + training), rounds and steps, with its round size R
    and batch B (rollouts generated = rounds x R, trained = steps x B)."""
    cfg, evals, last = record["config"], record["evals"], record["last"]
    R, B = cfg["prompts_per_round"] * cfg["num_generations"], cfg["batch_size"]
    picks = [next(r for r in evals if r["gen_tokens"] >= g) for g in grid]
    for a, b, g, before in zip(picks, picks[1:], grid[1:], grid):
        if a is b:      # one eval would count twice in the smoothing (a lucky one could set the target)
            raise CompareError(f"{name}: the eval at {a['gen_tokens']:,} tokens stands for the grid points "
                               f"below and at {g:,}: one round generated more tokens than the eval interval "
                               f"({g - before:,}); raise --budget-tokens or --early-tokens, or lower --evals "
                               f"or --early-evals")
    tail = record["entropy_tail"]
    return {
        "tokens": [r["gen_tokens"] for r in picks],
        "seconds": [r["gen_seconds"] + r["train_seconds"] for r in picks],
        # CPU seconds of generation + training (NaN in records older than them)
        "cpu_seconds": [r["gen_cpu_seconds"] + r["train_cpu_seconds"] if "gen_cpu_seconds" in r else math.nan
                        for r in picks],
        "rounds": [r["round"] for r in picks], "steps": [r["step"] for r in picks],
        "accuracy": [r["eval_accuracy"] for r in picks],
        "entropy": statistics.mean(tail) if tail else float("nan"), "R": R, "B": B,
        "gen_seconds": last["gen_seconds"], "train_seconds": last["train_seconds"],
        "rollouts_generated": last["round"] * R, "rollouts_trained": last["step"] * B,
        **record.get("staleness", {}),          # records written before 2026-12-01 have none (or no ratios)
        **({"reuse": record["reuse"]} if "reuse" in record else {}),
    }


# ---- reaching the target -------------------------------------------------------------------
def final_accuracy(accs: list[float]) -> float:
    """The median of the last three evals: one lucky or unlucky last eval does not decide it."""
    return statistics.median(accs[-3:])


def smoothed(accs: list[float], i: int) -> float:
    """The median of eval i and its two neighbours (the first and last evals: themselves)."""
    return statistics.median(accs[i - 1:i + 2]) if 0 < i < len(accs) - 1 else accs[i]


def reach_index(accs: list[float], target: float) -> int | None:
    """Index of the first eval from which the smoothed accuracy (median of the eval and its two
    neighbours) stays >= target to the end of the run; None if it never does. Only evals with two
    neighbours are smoothed, so the last one counts only within the median of the last three."""
    held = None
    for i in range(len(accs) - 2, 0, -1):                # from the last smoothed point backwards
        if smoothed(accs, i) < target - 1e-9:
            break
        held = i
    return held


def first_reach_index(accs: list[float], target: float) -> int | None:
    """Index of the first eval (after the start) at or above target, held afterwards or not: raw
    evals, unlike reach_index, so one that touches the target and falls back counts here; None if
    none does. From it on, a run that falls back is unstable (fall_after_reach)."""
    return next((i for i in range(1, len(accs)) if accs[i] >= target - 1e-9), None)


def reach_point(curve: dict, target: float) -> dict | None:
    """Where a curve (accuracy and X_KEYS at each eval) crosses the target: between the eval before
    the reach (i - 1) and the reach i, linearly in the smoothed accuracy s: each x at
        x[i-1] + f * (x[i] - x[i-1]),   f = (target - s[i-1]) / (s[i] - s[i-1])
    (tokens, seconds, rounds and steps alike); f = 1 (the reach eval itself) when s[i-1] is not below
    the target (a curve that starts above it). None: the curve does not reach."""
    accs = curve["accuracy"]
    i = reach_index(accs, target)
    return None if i is None else crossing(curve, i, smoothed(accs, i - 1), smoothed(accs, i), target)


def first_reach_point(curve: dict, target: float) -> dict | None:
    """Where a curve first touches the target (first_reach_index), placed as reach_point does, in
    the raw accuracy of the eval before and that eval; None: it never does."""
    accs = curve["accuracy"]
    i = first_reach_index(accs, target)
    return None if i is None else crossing(curve, i, accs[i - 1], accs[i], target)


def crossing(curve: dict, i: int, before: float, at: float, target: float) -> dict:
    f = (target - before) / (at - before) if before < target < at else 1.0
    return {k: curve[k][i - 1] + f * (curve[k][i] - curve[k][i - 1]) for k in X_KEYS if k in curve}


def fall_after_reach(accs: list[float], target: float) -> float | None:
    """A run's instability: its deepest fall below the target after it first reaches it, target -
    the lowest eval from there on (raw evals; 0 if none is below); None if it never reaches."""
    i = first_reach_index(accs, target)
    return None if i is None else max(0.0, target - min(accs[i:]))


def mean_curve(runs: list[dict]) -> dict[str, list[float]]:
    # math.fsum / n: statistics.fmean's own sum, the same floats, at half its cost (the bootstrap's inner loop)
    return {k: [math.fsum(r[k][j] for r in runs) / len(runs) for j in range(len(runs[0][k]))]
            for k in ("accuracy", *X_KEYS) if k in runs[0]}


def target_accuracy(on: list[dict], frac: float = 1.0) -> float:
    """The accuracy to reach: the on-policy arm's start plus frac of its gain to its final accuracy
    (frac 1: the final accuracy itself; below 1, a point on the rise of a curve that saturates,
    where "tokens to the plateau" would be decided by the plateau's noise)."""
    accs = mean_curve(on)["accuracy"]
    final = final_accuracy(accs)
    return min(accs[0] + frac * (final - accs[0]), final)     # a falling curve: its final accuracy


def control_of(arm: str) -> str | None:
    """The arm a replay arm is compared with directly: on-policy with the same R and as many updates
    per generated token (R = B = N = B/y), no reuse; the filtered replay arm's is the same filter
    with no reuse. None: no control (replay_y3)."""
    special = {"replay_y3": None, "replay_y4": "control_y4", "replay_y4_ppo": "control_y4",
               "replay_nonzero": "control_nonzero"}
    return special[arm] if arm in special else "control" if arm.startswith("replay") else None


# ---- time from a cost curve (comparison/cost.py) --------------------------------------------
def interpolate(points: list[list[float]], x: float, what: str) -> float:
    """y at x on measured points [(x, y), ...]: linear between the two around x, exact at a point.
    Linear in x, not log-log: a round's time is a fixed cost per call plus a cost per rollout, close
    to affine between neighbouring sizes, and linear interpolation is exact for any affine curve
    (log-log only for a power law). Outside the measured range: refused, not extrapolated."""
    points = sorted(points)
    if not points[0][0] <= x <= points[-1][0]:
        raise CompareError(f"{what} {x:g} is outside the cost curve's range {points[0][0]:g}..{points[-1][0]:g}: "
                           f"measure it (comparison/cost.py --sizes ...)")
    for (x0, y0), (x1, y1) in zip(points, points[1:] + [points[-1]]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)


def load_cost(path: str) -> dict:
    """A cost file of comparison/cost.py: its curves {generation mode: {"generation": [[R, seconds of
    one round's generation], ...], "training": [[B, seconds of one optimizer step], ...]}} and what
    it was measured on."""
    try:
        cost = json.load(open(path))
        # points that did not fit or were skipped carry no seconds: the curve ends before them
        training = [[p["B"], p["seconds"]] for p in cost["training"] if "seconds" in p]
        curves = {mode: {"generation": [[p["R"], p["seconds"]] for p in points if "seconds" in p], "training": training}
                  for mode, points in cost["generation"].items() if any("seconds" in p for p in points)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CompareError(f"--cost {path}: not a cost file of comparison/cost.py ({type(e).__name__}: {e})")
    if not curves or not training:
        raise CompareError(f"--cost {path}: no measured points")
    about = {k: cost.get(k) for k in ("device", "dtype", "threads", "conditions", "model", "task", "max_new_tokens",
                                      "torch", "transformers")}
    return {"file": path, "curves": curves, "about": about,
            "interpolation": "linear in R and in B between the measured points; refused outside them"}


def unit_costs(cost: dict | None, sizes: dict[str, tuple[int, int]]) -> dict:
    """{curve: {arm: (seconds per round at the arm's R, seconds per step at its B)}}; sizes: {arm:
    (R, B)}. Refuses (CompareError) an R or B outside a curve's range."""
    if not cost:
        return {}
    return {name: {arm: (interpolate(c["generation"], R, f"{arm}: R ="), interpolate(c["training"], B, f"{arm}: B ="))
                   for arm, (R, B) in sizes.items()} for name, c in cost["curves"].items()}


def share_units(on_policy: list[dict], sizes: dict[str, tuple[int, int]], shares: list[float]) -> dict:
    """Per share g of generation (a GPU's), each arm's seconds per round and per step projected from
    the on-policy runs' measured seconds per generated rollout (c_gen) and per trained one (c_train),
    training's scaled by k so that an on-policy run spends the share g generating:
        k = G (1 - g) / (g T),  G, T: its generation and training seconds (medians over its runs),
        per round R c_gen, per step B k c_train     (sizes: {arm: (R, B)}).
    A projection, not a measurement: the GPU's cost per trained rollout is taken as flat in B."""
    if not shares:
        return {}
    med = lambda f: statistics.median(f(r) for r in on_policy)
    c_gen = med(lambda r: r["gen_seconds"] / r["rollouts_generated"])
    c_train = med(lambda r: r["train_seconds"] / r["rollouts_trained"])
    G, T = med(lambda r: r["gen_seconds"]), med(lambda r: r["train_seconds"])
    return {f"gen share {100 * g:g}%": {arm: (R * c_gen, B * c_train * G * (1 - g) / (g * T))
                                        for arm, (R, B) in sizes.items()} for g in shares}


# ---- the figures of one set of replicates, and their intervals -------------------------------
def ratio(a: float, b: float) -> float:
    """a / b of two amounts to the target (inf: not reached): inf when a is not reached, 0 when only b."""
    return math.inf if math.isinf(a) else 0.0 if math.isinf(b) else a / b


def difference(a: float, b: float) -> float:
    """a - b of two figures that exist only where a run reached (inf: not reached): inf if either is."""
    return math.inf if math.isinf(a) or math.isinf(b) else a - b


def default_pairs(arms) -> list[tuple[str, str]]:
    """Every arm against on-policy, and every replay arm against its control (when it ran)."""
    return ([(a, "on_policy") for a in arms if a != "on_policy"]
            + [(a, control_of(a)) for a in arms if control_of(a) in arms])


def figures(results: dict[str, list[dict]], frac: float = 1.0, units: dict | None = None,
            pairs: list[tuple[str, str]] | None = None) -> dict:
    """The figures of one set of replicates (results[arm][i]: replicate i, which starts from model i in
    every arm): the target (from on_policy), each arm's reach of it on its mean curve, held to the end
    (tokens, seconds, rounds, steps; inf: not reached), and first touched ("first": the mean over
    the replicates of each one's first reach, inf if one never reaches; "evals_in_rise": the median
    of their first reach's eval index, the evals the rise spans), its time projected on each cost curve
        projected = rounds to target x gen(R) + steps to target x train(B),
    its instability (the mean over replicates that reached of fall_after_reach; inf: none reached),
    final accuracy and entropy; and for each pair (arm, reference) the ratios arm / reference of
    tokens and measured seconds to hold and to first reach the target, of projected seconds, and the
    accuracy, instability and entropy differences: out["arms"][arm]["vs"][reference]."""
    units = units or {}
    target = target_accuracy(results["on_policy"], frac)
    arms = {}
    for name, runs in results.items():
        curve = mean_curve(runs)
        point = reach_point(curve, target) or dict.fromkeys((k for k in X_KEYS if k in curve), math.inf)
        point["projected"] = {c: point["rounds"] * u[name][0] + point["steps"] * u[name][1] for c, u in units.items()}
        # first reach, per replicate (on the mean curve one replicate's early reach is hidden by the others)
        firsts = [first_reach_point(r, target) for r in runs]
        rises = [first_reach_index(r["accuracy"], target) for r in runs]
        falls = [f for f in (fall_after_reach(r["accuracy"], target) for r in runs) if f is not None]
        arms[name] = {**point, "first": {k: statistics.fmean(p[k] for p in firsts) if all(firsts) else math.inf
                                         for k in X_KEYS if k in curve},
                      "evals_in_rise": statistics.median(rises) if None not in rises else math.inf,
                      "instability": statistics.fmean(falls) if falls else math.inf,
                      "final_accuracy": final_accuracy(curve["accuracy"]),
                      "entropy": statistics.fmean(r["entropy"] for r in runs), "vs": {}}
    for name, ref in default_pairs(results) if pairs is None else pairs:
        a, o = arms[name], arms[ref]
        a["vs"][ref] = {"token_ratio": ratio(a["tokens"], o["tokens"]), "time_ratio": ratio(a["seconds"], o["seconds"]),
                        "cpu_time_ratio": ratio(a.get("cpu_seconds", math.nan), o.get("cpu_seconds", math.nan)),
                        "first_token_ratio": ratio(a["first"]["tokens"], o["first"]["tokens"]),
                        "first_time_ratio": ratio(a["first"]["seconds"], o["first"]["seconds"]),
                        "projected_ratio": {c: ratio(a["projected"][c], o["projected"][c]) for c in units},
                        "accuracy_diff": a["final_accuracy"] - o["final_accuracy"],
                        "instability_diff": difference(a["instability"], o["instability"]),
                        "entropy_diff": a["entropy"] - o["entropy"]}
    return {"target": target, "arms": arms}


def intervals(draws: list) -> list | dict:
    """The 90% percentile interval [lo, hi] of every figure over the draws, nested as one draw is."""
    if isinstance(draws[0], dict):
        return {k: intervals([d[k] for d in draws]) for k in draws[0]}
    values = sorted(draws)
    n = len(values)
    return [values[int(0.05 * (n - 1))], values[int(math.ceil(0.95 * (n - 1)))]]


def bootstrap(results: dict[str, list[dict]], n: int, seed: int = 0, frac: float = 1.0, units: dict | None = None,
              pairs: list[tuple[str, str]] | None = None) -> dict:
    """90% intervals of figures(), resampling replicates with replacement. Replicate i of every arm
    starts from the same model with the same seed, so a draw takes the same replicates in every arm
    (replay i with control i and on-policy i): the target is recomputed and every ratio is taken
    within the draw, never as a ratio of two intervals. Also each arm's not_reached_frac."""
    rng = random.Random(seed)
    k = len(results["on_policy"])
    draws = []
    for _ in range(n):
        idx = rng.choices(range(k), k=k)
        draws.append(figures({a: [runs[i] for i in idx] for a, runs in results.items()}, frac, units, pairs))
    out = intervals(draws)
    for a in results:
        out["arms"][a]["not_reached_frac"] = sum(math.isinf(d["arms"][a]["tokens"]) for d in draws) / n
    return out


def sweep_target(on_policy: dict[float, list[dict]], frac: float = 1.0) -> float:
    """The target every arm's lr is chosen by: the highest on-policy target over the sweep's lrs
    (on_policy: {lr: its sweep runs}), the best that on-policy learning showed it can hold."""
    return max(target_accuracy(runs, frac) for runs in on_policy.values())


def choose_lr(runs_by_lr: dict[float, list[dict]], target: float) -> dict:
    """One arm's lr, by what the tables report: the fewest tokens to hold the target on the mean curve
    of its sweep replicates (runs_by_lr: {lr: runs}; not reached: the worst), ties (not reached by
    several, say) broken by the larger area under the curve (sweep_score), then the smaller lr.
    Also the lr the area alone would choose, and whether the choice lies on the edge of the grid
    (then widen it: the best may lie outside)."""
    hold = {lr: (reach_point(mean_curve(runs), target) or {"tokens": math.inf})["tokens"]
            for lr, runs in sorted(runs_by_lr.items())}
    area = {lr: statistics.fmean(sweep_score(r) for r in runs) for lr, runs in sorted(runs_by_lr.items())}
    chosen = min(hold, key=lambda lr: (hold[lr], -area[lr], lr))
    by_area = max(area, key=lambda lr: (area[lr], -lr))
    return {"chosen": chosen, "tokens_to_hold": {lr: finite(t) for lr, t in hold.items()}, "mean_score": area,
            "area_choice": by_area, "rules_agree": chosen == by_area,
            "on_grid_edge": len(hold) > 1 and chosen in (min(hold), max(hold))}


def sweep_score(run: dict) -> float:
    """A sweep's score of one run: its mean accuracy over the evals (the area under its accuracy
    against generated tokens), which rewards learning fast and holding it, not one final eval."""
    return statistics.fmean(run["accuracy"])


RISE_EVALS = 5          # the evals a rise must span for its token figures to resolve it


def verdict(ratio_interval: list, diff_interval: list, first_interval: list | None = None,
            rise_evals: float | None = None) -> str:
    """Plain words for the intervals against a reference: tokens to hold the target (None or inf: not
    reached), the final accuracy difference, and (with first_interval) tokens to first reach it,
    which says whether a difference comes from the rise or from holding; rise_evals: the evals the
    fastest arm's rise spans (fewer than RISE_EVALS: the token figures cannot resolve it; None: no
    arm's rise, nothing to say)."""
    def inf_for_none(interval):             # None in a stored interval: not reached
        return [math.inf if x is None else x for x in interval]

    def words(lo, hi):
        return "fewer tokens" if hi < 1 else "more tokens" if lo > 1 else "tokens within noise"
    hold_lo, hold_hi = inf_for_none(ratio_interval)
    tokens = words(hold_lo, hold_hi)
    lo, hi = diff_interval
    acc = ("higher final accuracy" if lo > 0 else "lower final accuracy" if hi < 0 else "final accuracy within noise")
    if first_interval is None:              # a summary older than the first-reach figures
        return f"{tokens}; {acc}"
    first_lo, first_hi = inf_for_none(first_interval)
    first = words(first_lo, first_hi)
    noise = "tokens within noise"
    source = ("" if tokens == first == noise else
              ": slower to rise, and slower still to hold: most of the difference comes from falling back"
              if tokens == first == "more tokens" and first_hi < hold_lo else
              ": sooner to rise, and sooner still to hold" if tokens == first == "fewer tokens" and hold_hi < first_lo else
              ": the difference comes from the rise" if tokens == first else
              ": the difference comes from holding the target, not the rise" if first == noise else
              ": a difference in the rise that holding evens out" if tokens == noise else
              ": it rises sooner but falls back: the difference comes from holding" if first == "fewer tokens" else
              ": it rises later but holds sooner")
    line = f"to hold the target {tokens}, to first reach it {first}{source}; {acc}"
    if rise_evals is not None and rise_evals < RISE_EVALS:
        line += (f" (the fastest rise spans {rise_evals:g} eval(s), fewer than {RISE_EVALS}: "
                 "too coarse to tell; more evals or a smaller budget)")
    return line


def entry_verdict(entry: dict, rise_evals=None) -> str:
    """The verdict line of a summary's arm entry, from its own stored intervals (None: not reached)."""
    first = entry.get("first_reach_token_ratio_ci")
    return verdict(entry["token_ratio_ci"], entry["accuracy_diff_ci"], first, rise_evals if first else None)


def verdicts_that_disagree(s: dict) -> list[str]:
    """The verdict lines of a summary (against on-policy and against a control) that its own
    intervals do not give: [] when every line says what its figures say."""
    rise = (s.get("rise") or {}).get("fastest_evals")
    pairs = [(f"{a} / on_policy", e) for a, e in s["arms"].items() if "verdict" in e]
    pairs += [(f"{a} / {e['vs_control']['arm']}", e["vs_control"]) for a, e in s["arms"].items()
              if "verdict" in e.get("vs_control", {})]
    return [f"{name}: says {e['verdict']!r}, its figures give {entry_verdict(e, rise)!r}"
            for name, e in pairs if e["verdict"] != entry_verdict(e, rise)]


# ---- running the arms ----------------------------------------------------------------------
def threads_env(threads: int = 1, **extra: str) -> dict:
    """The environment of a child process with this many torch threads (runs side by side, one
    thread each, do not fight for the cores), and any extra variables."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra}


def build_tiny_model(task: str, warm_start_seed: int, warm_start_steps: int = 0, env: dict | None = None) -> None:
    """The embedded model of one warm start (demo_model.py), built and cached in a process of its own
    (one thread, unless env says otherwise)."""
    subprocess.run([sys.executable, "demo_model.py", "--task", task, "--warm-start-seed", str(warm_start_seed),
                    "--warm-start-steps", str(warm_start_steps)], cwd=ROOT, env=env or threads_env(), check=True,
                   stdout=subprocess.DEVNULL)


def record_argv(argv: list[str]) -> list[str]:
    """A run's flags without its output folder: a record stands for the run on any machine."""
    i = argv.index("--output-dir")
    return argv[:i] + argv[i + 2:]


def starting_model(model: str, task: str, warm_start_seed: int, warm_start_steps: int = 0) -> str:
    """What a run starts from, as a record keeps it: a hub id or folder as given; the embedded model
    by its spec's hash (demo_model.spec): the same flags name another model once its warm start changes."""
    if model != "tiny":
        return model
    import demo_model
    import tasks
    task_ = tasks.load_task(task)
    return os.path.basename(demo_model.cache_path(task_, demo_model.spec(task_, warm_start_steps or None, warm_start_seed)))


def record_path(records: str, name: str, argv: list[str], model: str) -> str:
    """Where a run's record lies: records/<arm>/seed<i>-<key>.json, the key a hash of everything that
    makes the run what it is (its flags, the lr included, and its starting model), so that a run with
    other flags never overwrites the record another summary was computed from."""
    import hashlib
    key = hashlib.sha256(json.dumps([record_argv(argv), model]).encode()).hexdigest()[:10]
    return os.path.join(records, f"{name}-{key}.json")


def load_record(path: str, argv: list[str], model: str) -> dict | None:
    """The record at path if it is of a run with these flags from this starting model (else None:
    the run is due)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        record = json.load(f)
    return record if record.get("argv") == record_argv(argv) and record.get("model") == model else None


def save_record(path: str, record: dict) -> None:
    """Written whole or not at all (a temporary file, then renamed)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    checkpoint.write_json(path, record, indent=1)


def run_train(argv: list[str], out: str, env: dict | None = None) -> None:
    """One train.py run in its own process, one torch thread (unless env says otherwise). A finished
    run (done.json with the same flags) is not run again: an interrupted comparison picks up where it
    stopped; a run folder of other flags is run afresh."""
    done = os.path.join(out, "done.json")
    if os.path.exists(done) and json.load(open(done)) == argv:
        return
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    env = env or threads_env()
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
                keep_correct_frac=0.3, early_evals=10)
QUICK = dict(budget_tokens=5_000, seeds=2, eval_prompts=100, evals=4, bootstrap=200)
# train.py flags that --train-args may not hold although compare.py does not set them: why
NOT_PASSED = {"resume": "compare.py starts its own runs",
              "eval_every": "the runs evaluate at token thresholds instead (--evals)",
              "eval_at_tokens": "the runs evaluate at compare.py's grid (--evals, --early-tokens)"}


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="compare.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="runs/compare", help="folder for the runs, summary.json and curves.png")
    p.add_argument("--budget-tokens", type=int, help="generated completion tokens per run (default 450,000)")
    p.add_argument("--seeds", type=int, help="replicates per arm (default 5; intervals need 5 or more); "
                                             "replicate i starts from warm-start seed i with RL seed i")
    p.add_argument("--one-model", action="store_true",
                   help="tiny model only: every replicate starts from the default model (warm-start seed 0); only "
                        "the RL seed varies (not with --sweep-lr: its replicates would start from the reported "
                        "runs' model)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side, one torch thread each")
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
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS + OPTIONAL_ARMS, help="arms to run")
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
    if "on_policy" not in args.arms:
        p.error("--arms must include on_policy (it sets the target)")
    if args.replay_ratio < 2:
        p.error(f"--replay-ratio {args.replay_ratio}: must be >= 2")
    if args.prompts_per_round is not None and not args.skip_zero_advantage:
        p.error(f"--prompts-per-round {args.prompts_per_round}: the filtered design's (--skip-zero-advantage); "
                "the other arms' rounds follow from B, y and G")
    if args.skip_zero_advantage and args.prompts_per_round is None:
        args.prompts_per_round = 4
    if args.skip_zero_advantage and (wrong := [a for a in args.arms if a not in FILTERED_ARMS]):
        p.error(f"--arms {wrong[0]} with --skip-zero-advantage: the filtered design has the arms "
                f"{', '.join(FILTERED_ARMS)}")
    if not all(0 < g < 1 for g in args.gen_shares):
        p.error(f"--gen-shares {args.gen_shares}: each must be in (0, 1)")
    for y in {args.replay_ratio, *(FIXED_Y[a] for a in args.arms if a in FIXED_Y)}:
        if args.batch_size % (y * args.num_generations):
            p.error(f"--batch-size {args.batch_size} must be a multiple of replay ratio x num_generations "
                    f"= {y * args.num_generations}")
    if not 0 < args.target_frac <= 1:
        p.error(f"--target-frac {args.target_frac}: must be in (0, 1]")
    if args.evals < 3 or args.seeds < 1 or args.jobs < 1 or args.sweep_seeds < 1:
        p.error("--evals must be >= 3, --seeds, --sweep-seeds and --jobs >= 1")
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


def train_flags(argv: list[str]) -> dict:
    """train.py's flags among argv, read by train.py's own parser: {field: value} of those given.
    A flag train.py does not have, or a bad value, stops here in one line."""
    parser = cli.build_parser(train.Config, explicit_only=True)
    parser.prog = "compare.py --train-args"
    return vars(parser.parse_args(argv))


def warm_start_seed(args, seed: int) -> int:
    return 0 if args.one_model else seed


def token_grid(args) -> list[int]:
    """The generated-token thresholds every run evaluates at: 0, one interval, ..., the budget; with
    --early-tokens T, --early-evals of them evenly up to T, then --evals evenly from T to the budget."""
    start, grid = 0, []
    for end, evals in ([(args.early_tokens, args.early_evals)] if args.early_tokens else []) + [
            (args.budget_tokens, args.evals)]:
        interval = -(-(end - start) // evals)                          # ceil: the last threshold is the end
        grid += [start + k * interval for k in range(evals) if start + k * interval < end]
        start = end
    return grid + [args.budget_tokens]


def eval_flags(grid: list[int]) -> list[str]:
    """train.py's flags for evals at the grid's thresholds: a uniform grid as --eval-every-tokens (the
    flag of the records before --early-tokens, so they still match), any other as --eval-at-tokens."""
    if grid == [k * grid[1] for k in range(len(grid) - 1)] + [grid[-1]]:
        return ["--eval-every-tokens", str(grid[1])]
    return ["--eval-at-tokens", ",".join(map(str, grid[1:]))]


def own_flags(args, arm: str, seed: int, lr: float, out: str) -> list[str]:
    """The train.py flags compare.py sets for one run (replicate seed of an arm at lr): the arm's,
    the replicate's model and seed, the lr, the budget and the eval grid. A run gets these, then
    --train-args, which may hold none of them (parse refuses it)."""
    model = ["--warm-start-seed", str(warm_start_seed(args, seed))] if args.model == "tiny" else []
    # Every run evaluates when its generated tokens cross the same thresholds: curves line up.
    return arm_flags_of(args, arm) + model + [
        "--seed", str(seed), "--lr", str(lr), "--output-dir", out, "--model", args.model, "--task", args.task,
        "--num-generations", str(args.num_generations), "--max-gen-tokens", str(args.budget_tokens),
        "--max-rounds", str(10**9), *eval_flags(token_grid(args)),
        "--eval-prompts", str(args.eval_prompts), "--no-progress"]


def arm_flags_of(args, arm: str) -> list[str]:
    """arm_flags with the comparison's settings."""
    filtered = args.prompts_per_round if getattr(args, "skip_zero_advantage", False) else 0
    return arm_flags(arm, args.batch_size, args.replay_ratio, args.num_generations, args.keep_correct_frac, filtered)


def plain_flags(args) -> list[str]:
    """train.py's own defaults for what a model's defaults (cli.MODEL_DEFAULTS: smollm2 samples at
    temperature 0.7 and stores only groups of mixed rewards) would change and compare.py does not set:
    an arm is its flags, whatever the model. They come first: an arm's flags and --train-args win."""
    own = train_flags(own_flags(args, "on_policy", 0, args.lr, "run"))
    flags = []
    for name in sorted(cli.MODEL_DEFAULTS.get(args.model, {}).keys() - own.keys() - NOT_PASSED.keys()):
        default, flag = getattr(train.Config, name), "--" + name.replace("_", "-")
        flags += ([flag] if default else ["--no-" + flag[2:]]) if isinstance(default, bool) else [flag, str(default)]
    return flags


def compare(args) -> dict:
    try:        # its runs are rewritten from scratch: two comparisons in one folder would mix
        checkpoint.lock_folder(args.output_dir, what="a comparison in progress")
    except checkpoint.RunFolderBusy as e:
        raise CompareError(str(e)) from None
    grid = token_grid(args)
    cost = load_cost(args.cost) if args.cost else None
    sizes = {}
    for arm in args.arms:
        flags = arm_flags_of(args, arm)
        sizes[arm] = (int(flags[1]) * args.num_generations, int(flags[5]))
    unit_costs(cost, sizes)                     # an arm outside the cost curve: refused before any run

    sweep_seeds = list(range(1000, 1000 + args.sweep_seeds)) if args.sweep_lr else []
    steps = train_flags(args.train_args).get("warm_start_steps", 0)
    built, locks = set(), {warm_start_seed(args, s): threading.Lock() for s in [*range(args.seeds), *sweep_seeds]}
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
        record = load_record(path, argv, model) if path else None
        if record is None:
            need_model(seed)
            run_train(argv, out)
            record = {"argv": record_argv(argv), "model": model, **run_record(out)}
            if path:
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
            sweep_at = sweep_target(swept["on_policy"], args.target_frac)
            for arm in ["on_policy"] + [a for a in args.arms if a != "on_policy"]:
                sweep[arm] = choose_lr(swept[arm], sweep_at)
                lrs[arm] = sweep[arm]["chosen"]
                if not sweep[arm]["rules_agree"] and arm != "on_policy":     # would the area's choice change it?
                    on = swept["on_policy"][lrs["on_policy"]]
                    sweep[arm]["sweep_token_ratio"] = {
                        f"{lr:g}": finite(figures({"on_policy": on, arm: swept[arm][lr]}, args.target_frac, pairs=[
                            (arm, "on_policy")])["arms"][arm]["vs"]["on_policy"]["token_ratio"])
                        for lr in (sweep[arm]["chosen"], sweep[arm]["area_choice"])}
                print(f"{arm}: lr sweep ({len(sweep_seeds)} replicates) tokens to hold {sweep_at:.3f} "
                      f"{ {f'{k:g}': v and round(v) for k, v in sweep[arm]['tokens_to_hold'].items()} } -> {lrs[arm]:g}"
                      + ("" if sweep[arm]["rules_agree"] else
                         f" (the area under the curve would choose {sweep[arm]['area_choice']:g})")
                      + (" (ON THE EDGE of the grid: widen it)" if sweep[arm]["on_grid_edge"] else ""), flush=True)
        jobs = {(arm, seed): pool.submit(run, arm, seed, lrs[arm]) for seed in range(args.seeds) for arm in args.arms}
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
    checkpoint.write_json(os.path.join(args.output_dir, "summary.json"), summary, indent=2)
    print_table(summary)
    plot(summary, os.path.join(args.output_dir, "curves.png"))
    return summary


def finite(x):
    """JSON has no inf: None (not reached), also inside lists."""
    return [finite(v) for v in x] if isinstance(x, list) else None if math.isinf(x) else x


def pair_entry(point: dict, ci: dict) -> dict:
    """figures()'s ratios and differences of one pair, with their intervals, for summary.json."""
    return {"token_ratio": finite(point["token_ratio"]), "token_ratio_ci": finite(ci["token_ratio"]),
            "time_ratio": finite(point["time_ratio"]), "time_ratio_ci": finite(ci["time_ratio"]),
            **({"cpu_time_ratio": finite(point["cpu_time_ratio"]), "cpu_time_ratio_ci": finite(ci["cpu_time_ratio"])}
               if not math.isnan(point["cpu_time_ratio"]) else {}),
            "projected_time_ratio": {c: {"ratio": finite(v), "ci": finite(ci["projected_ratio"][c])}
                                     for c, v in point["projected_ratio"].items()},
            "first_reach_token_ratio": finite(point["first_token_ratio"]),
            "first_reach_token_ratio_ci": finite(ci["first_token_ratio"]),
            "first_reach_time_ratio": finite(point["first_time_ratio"]),
            "first_reach_time_ratio_ci": finite(ci["first_time_ratio"]),
            "accuracy_diff": point["accuracy_diff"], "accuracy_diff_ci": ci["accuracy_diff"],
            "instability_diff": finite(point["instability_diff"]), "instability_diff_ci": finite(ci["instability_diff"]),
            "entropy_diff": point["entropy_diff"], "entropy_diff_ci": ci["entropy_diff"]}


def summarize(results: dict[str, list[dict]], args, grid: list[float], lrs: dict, cost: dict | None = None) -> dict:
    op = results["on_policy"]
    # the cost ratio, measured on the on-policy arm: seconds per generated rollout / per trained rollout
    cost_ratio = statistics.median((r["gen_seconds"] / r["rollouts_generated"]) / (r["train_seconds"] / r["rollouts_trained"])
                           for r in op)
    sizes = {arm: (runs[0]["R"], runs[0]["B"]) for arm, runs in results.items()}
    curve_units = unit_costs(cost, sizes)
    units = {**curve_units, **share_units(op, sizes, getattr(args, "gen_shares", []))}
    fig = figures(results, args.target_frac, units)
    ci = bootstrap(results, args.bootstrap, frac=args.target_frac, units=units)
    target = fig["target"]
    if args.model == "tiny" and not args.one_model:
        replicates = "warm-start seed i and RL seed i: the model varies"
    else:
        replicates = f"one model ({'tiny, warm-start seed 0' if args.model == 'tiny' else args.model}), RL seed i"
    summary = {"task": args.task, "model": args.model, "train_args": args.train_args,
               "target_accuracy": target, "target_accuracy_ci": ci["target"], "target_frac": args.target_frac,
               "cost_ratio": cost_ratio, "budget_tokens": args.budget_tokens, "grid_tokens": grid, "lr": lrs,
               "lr_chosen_by": "sweep" if args.sweep_lr else "given",
               "seconds_measured": f"generation + training (evals excluded), {args.jobs} run(s) side by side, "
                                   "one torch thread each",
               "reach_rule": "first eval from which the median of each eval and its two neighbours stays >= target; "
                             "the crossing interpolated linearly between the eval before and that one (tokens, "
                             "seconds, rounds and steps alike)",
               "first_reach_rule": "per replicate, the first eval >= target (raw, not smoothed), held or not, "
                                   "interpolated alike in the raw accuracy; the arm's figure: the mean over its "
                                   "replicates (not reached if one never reaches); evals in the rise: the median of "
                                   "their first reach's eval index",
               "instability_rule": "per replicate that first reaches the target: target - its lowest eval from "
                                   "there on (0 if none is below); the arm's figure: the mean over those replicates",
               "replicates": replicates,
               "intervals": f"90% bootstrap over replicates: each draw takes replicate i of every arm together (one "
                            f"starting model), recomputes the target, and takes every ratio within the draw "
                            f"({args.bootstrap} resamples)",
               "cost": cost and {k: cost[k] for k in ("file", "about", "interpolation")} | {"curves": list(curve_units)},
               "gen_share_projection": getattr(args, "gen_shares", None) and (
                   "projected, not measured: seconds to the target with each run's rounds charged at the on-policy "
                   "runs' measured seconds per generated rollout and its steps at their seconds per trained one, "
                   "training scaled so that an on-policy run spends the share given generating (a GPU's: "
                   "docs/gpu.md measured 86-96%)"),
               "args": vars(args), "arms": {}}
    # how finely the evals resolve the rise: the evals from the start to each arm's first reach
    evals = {a: finite(f["evals_in_rise"]) for a, f in fig["arms"].items()}
    fastest = min((a for a in evals if evals[a] is not None), key=lambda a: fig["arms"][a]["first"]["tokens"],
                  default=None)         # None: in every arm some replicate never touched the target
    rise = {"evals_in_rise": evals, "fastest_arm": fastest, "fastest_evals": evals[fastest] if fastest else None,
            "needed": RISE_EVALS, "resolved": fastest is not None and evals[fastest] >= RISE_EVALS}
    summary["rise"] = rise
    for name, runs in results.items():
        f, c = fig["arms"][name], ci["arms"][name]
        R, B = sizes[name]
        curve = mean_curve(runs)
        accs = [r["accuracy"] for r in runs]
        entry = {
            "R": R, "B": B, "final_accuracy": f["final_accuracy"],
            "final_accuracy_range": [min(final_accuracy(a) for a in accs), max(final_accuracy(a) for a in accs)],
            **{f"{k}_to_target": finite(f[k]) for k in X_KEYS if k in f},
            **{f"{k}_to_target_ci": finite(c[k]) for k in X_KEYS if k in c},
            "generated_to_target": finite(f["rounds"] * R), "trained_to_target": finite(f["steps"] * B),
            **{f"{k}_to_first_reach": finite(f["first"][k]) for k in ("tokens", "seconds")},
            **{f"{k}_to_first_reach_ci": finite(c["first"][k]) for k in ("tokens", "seconds")},
            "evals_in_rise": finite(f["evals_in_rise"]),
            "instability": finite(f["instability"]), "instability_ci": finite(c["instability"]),
            "projected_seconds_to_target": {u: {"seconds": finite(v), "ci": finite(c["projected"][u])}
                                            for u, v in f["projected"].items()},
            "not_reached_frac": c["not_reached_frac"],
            "entropy": f["entropy"], "seeds": len(runs),
            # mean over the replicates of each run's mean over its steps (largest: over every step)
            **({"truncated_frac": statistics.fmean(r["truncated_frac"] for r in runs),
                "truncated_frac_max": max(r["truncated_frac_max"] for r in runs),
                "age_mean": statistics.fmean(r["age_mean"] for r in runs),
                "age_max": max(r["age_max"] for r in runs)} if all("age_mean" in r for r in runs) else {}),
            **({"is_ratio_mean": statistics.fmean(r["is_ratio_mean"] for r in runs),
                "is_ratio_max": max(r["is_ratio_max"] for r in runs)} if all("is_ratio_mean" in r for r in runs) else {}),
            "gen_seconds": statistics.fmean(r["gen_seconds"] for r in runs),
            "train_seconds": statistics.fmean(r["train_seconds"] for r in runs),
            "flags": " ".join(arm_flags_of(args, name)),
            "curve": {**curve, "min": [min(a[j] for a in accs) for j in range(len(grid))],
                      "max": [max(a[j] for a in accs) for j in range(len(grid))],
                      "projected": {u: [r * g + s * t for r, s in zip(curve["rounds"], curve["steps"])]
                                    for u, (g, t) in ((u, units[u][name]) for u in units)}},
            # each replicate's own run and its own reach of the (mean curve's) target
            "replicates": [{**run, "reach": reach_point(run, target)} for run in runs],
        }
        if any(math.isnan(x) for r in runs for x in r.get("cpu_seconds", [math.nan])):  # records before them
            entry = {k: v for k, v in entry.items() if not k.startswith("cpu_seconds")}
            entry["curve"].pop("cpu_seconds", None)
            entry["replicates"] = [{k: v for k, v in r.items() if k != "cpu_seconds"} for r in entry["replicates"]]
            entry["replicates"] = [{**r, "reach": r["reach"] and {k: v for k, v in r["reach"].items()
                                                                   if k != "cpu_seconds"}} for r in entry["replicates"]]
        if all("reuse" in r for r in runs):
            entry["reuse"] = measured_reuse(name, [r["reuse"] for r in runs])
        for ref, point in f["vs"].items():
            pair = pair_entry(point, c["vs"][ref])
            pair["verdict"] = entry_verdict(pair, rise["fastest_evals"])
            if ref == "on_policy":
                entry.update(pair)
            else:
                entry["vs_control"] = {"arm": ref, **pair}
        summary["arms"][name] = entry
    others = {a: e for a, e in summary["arms"].items() if not a.startswith(("on_policy", "control"))}
    reached = {a: e for a, e in others.items() if e["token_ratio"] is not None}
    best = min(reached, key=lambda a: reached[a]["token_ratio"], default=None)
    summary["best_replay_arm"] = best
    for key in ("token_ratio", "time_ratio", "projected_time_ratio"):
        summary[key] = summary["arms"][best][key] if best else None
    return summary


def measured_reuse(arm: str, reuse: list[dict]) -> dict:
    """An arm's replay as its runs measured it (reuse: each replicate's record["reuse"]): the uses of a
    stored rollout (trained on / stored: the lowest, mean and highest replicate), the share of the
    generated ones stored, the rollouts gone from the buffer by their uses (summed), the ages they
    were trained at. An on-policy arm whose rollouts were not each used once, at age 0, is flagged."""
    uses = [r["rollouts_trained"] / max(r["rollouts_stored"], 1) for r in reuse]
    longest = max(len(r["left_by_uses"]) for r in reuse)
    left = [sum((r["left_by_uses"] + [0] * longest)[i] for r in reuse) for i in range(longest)]
    out = {"uses_per_stored": [min(uses), statistics.fmean(uses), max(uses)],
           "stored_frac": statistics.fmean(r["rollouts_stored"] / max(r["rollouts_generated"], 1) for r in reuse),
           "left_by_uses": left, "age_mean": statistics.fmean(r["age_mean"] for r in reuse),
           "age_max": max(r["age_max"] for r in reuse)}
    if arm == "on_policy" and (any(n for i, n in enumerate(left) if i != 1) or out["age_max"] > 0):
        out["flag"] = ("NOT ON-POLICY: its rollouts were not all used once at age 0 (left the buffer by uses "
                       f"{left}, trained at ages up to {out['age_max']})")
    return out


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def fmt_ci(value, ci, spec=".2f"):
    lo, hi = ci
    return f"{fmt(value, spec)} [{fmt(lo, spec)}, {'not reached' if hi is None else format(hi, spec)}]"


def whose(s: dict) -> str:
    """Whose task and model a summary's results come from."""
    if "task" not in s:
        return "task and model: not recorded (a summary older than this field; its arms' flags say the rest)"
    extra = f", train.py {s['train_args']}" if s.get("train_args") else ""
    return f"task {s['task']}, model {s['model']}{extra}; replicates: {s['replicates']}"


def about_cost(cost: dict, task: str | None = None, model: str | None = None) -> str:
    """What a cost curve was measured on; and, given the runs' task and model, whether it is theirs."""
    a = cost["about"]
    line = (f"cost curve {cost['file']}: {a.get('device')} {a.get('dtype')}, {a.get('threads')} thread(s), model "
            f"{a.get('model')}, task {a.get('task')}, {a.get('max_new_tokens')} new tokens at most; "
            f"{a.get('conditions')}; {cost['interpolation']}")
    if task is not None and (a.get("task"), a.get("model")) != (task, model):
        line += (f"\nnote: the runs are of task {task}, model {model}: their rounds and steps are charged at "
                 f"this curve's seconds (what these runs would cost there), not at their own")
    return line


def print_table(s: dict) -> None:
    rule = ("on-policy final, median of its last 3 evals" if s.get("target_frac", 1.0) == 1.0 else
            f"on-policy start + {s['target_frac']:g} of its gain to its final accuracy")
    print(f"\nresults: {whose(s)}")
    print(f"target accuracy ({rule}): {s['target_accuracy']:.3f};  measured cost ratio "
          f"{s.get('cost_ratio', s.get('mu')):.2f} (generation / training seconds per rollout, a summary figure);  lr {s['lr_chosen_by']}: {s['lr']}")
    if s.get("cost"):
        print(about_cost(s["cost"], s.get("task"), s.get("model")))
    for arm, sw in (s.get("lr_sweep") or {}).get("arms", {}).items():
        means = ", ".join(f"{float(lr):g}: {v:.3f}" for lr, v in sw["mean_score"].items())   # a key of JSON: a string
        hold = ", ".join(f"{float(lr):g}: {fmt(t, ',.0f')}" for lr, t in sw.get("tokens_to_hold", {}).items())
        print(f"lr sweep {arm}: " + (f"tokens to hold {hold}; " if hold else "") + f"mean accuracy {means} -> "
              f"{sw['chosen']:g}" + ("" if sw.get("rules_agree", True) else
                                     f" (by the area alone: {sw['area_choice']:g}; token ratio to on_policy on the "
                                     f"sweep replicates {sw.get('sweep_token_ratio')})")
              + (" (on the edge of the grid)" if sw["on_grid_edge"] else ""))
    curves = list(next(iter(s["arms"].values())).get("projected_seconds_to_target", {}))
    first = "tokens_to_first_reach" in next(iter(s["arms"].values()))     # summaries before 2026-12-01: none
    print(f"{'arm':<16}{'R':>5}{'B':>5}{'final acc':>10}{'range':>11}{'tokens->hold [90%]':>26}"
          f"{'measured s->hold [90%]':>28}" + "".join(f"{'projected s (' + u + ')':>30}" for u in curves)
          + (f"{'tokens->first reach':>26}{'evals':>6}{'fall after reach':>22}" if first else "")
          + f"{'entropy':>9}{'gen s':>8}{'train s':>9}")
    for name, a in s["arms"].items():
        lo, hi = a["final_accuracy_range"]
        print(f"{name:<16}{a['R']:>5}{a['B']:>5}{a['final_accuracy']:>10.3f}{f'{lo:.2f}-{hi:.2f}':>11}"
              f"{fmt_ci(a['tokens_to_target'], a['tokens_to_target_ci'], ',.0f'):>26}"
              f"{fmt_ci(a['seconds_to_target'], a['seconds_to_target_ci'], '.1f'):>28}"
              + "".join(f"{fmt_ci(p['seconds'], p['ci'], '.1f'):>30}" for p in a["projected_seconds_to_target"].values())
              + (f"{fmt_ci(a['tokens_to_first_reach'], a['tokens_to_first_reach_ci'], ',.0f'):>26}"
                 f"{fmt(a['evals_in_rise'], 'g'):>6}{fmt_ci(a['instability'], a['instability_ci'], '.3f'):>22}"
                 if first else "")
              + f"{a['entropy']:>9.3f}{a['gen_seconds']:>8.1f}{a['train_seconds']:>9.1f}")
    if s.get("rise") and s["rise"]["fastest_arm"] is None:
        print("the rise: in every arm some replicate never touched the target")
    elif s.get("rise"):
        r = s["rise"]
        print(f"the rise (start to first reach) of the fastest arm, {r['fastest_arm']}, spans {r['fastest_evals']} "
              f"eval(s); {'at least' if r['resolved'] else 'fewer than'} the {r['needed']} that resolve it"
              + ("" if r["resolved"] else ": its token figures are coarse (--early-tokens: a denser grid where it rises)"))

    def ratios(p: dict) -> str:
        lo, hi = p["time_ratio_ci"]
        inside = lambda r: "" if r is None or lo is None else (     # a curve of the machine that ran the runs should agree
            " (within the measured ratio's interval)" if lo <= r <= (math.inf if hi is None else hi)
            else " (outside the measured ratio's interval: expected if the curve is of another machine)")
        proj = "".join(f"; projected time ({u}) x{fmt_ci(v['ratio'], v['ci'])}{inside(v['ratio'])}"
                       for u, v in p["projected_time_ratio"].items())
        first = (f"; to first reach x{fmt_ci(p['first_reach_token_ratio'], p['first_reach_token_ratio_ci'])} tokens; "
                 f"fall after reach {fmt_ci(p['instability_diff'], p['instability_diff_ci'], '+.3f')}"
                 if "first_reach_token_ratio" in p else "")
        cpu = (f"; CPU time x{fmt_ci(p['cpu_time_ratio'], p['cpu_time_ratio_ci'])}" if "cpu_time_ratio" in p else "")
        return (f"tokens to hold the target x{fmt_ci(p['token_ratio'], p['token_ratio_ci'])}; measured time "
                f"x{fmt_ci(p['time_ratio'], p['time_ratio_ci'])}{cpu}{proj}{first}; final accuracy "
                f"{fmt_ci(p['accuracy_diff'], p['accuracy_diff_ci'], '+.3f')}; entropy "
                f"{fmt_ci(p['entropy_diff'], p['entropy_diff_ci'], '+.3f')}")
    print("\nagainst on_policy, point [90% interval over replicates]; measured time: seconds in the runs' logs; "
          "projected: the runs' rounds and steps to the target charged at the cost curve's seconds")
    for name, a in s["arms"].items():
        if name != "on_policy":
            print(f"{name}: {ratios(a)} -> {a['verdict']}")
    paired = {name: a["vs_control"] for name, a in s["arms"].items() if "vs_control" in a}
    if paired:
        print("\nreplay against its own control (R = B = N = B/y: as many updates per generated token, no reuse), "
              "paired draws (replicate i of both in each draw, the ratio taken within it)")
    for name, p in paired.items():
        print(f"{name} / {p['arm']}: {ratios(p)}" + (f" -> {p['verdict']}" if "verdict" in p else ""))
    print(f"best replay arm (tokens): {s['best_replay_arm']}")
    reuse = {name: a["reuse"] for name, a in s["arms"].items() if "reuse" in a}
    if reuse:
        print("\nreplay as measured: uses of a stored rollout (trained on / stored: lowest, mean, highest "
              "replicate), share of the generated stored, rollouts gone by uses [unused, once, ...], ages")
    for name, r in reuse.items():
        lo, mean, hi = r["uses_per_stored"]
        print(f"{name}: used {mean:.2f} times ({lo:.2f}-{hi:.2f}), {100 * r['stored_frac']:.0f}% stored, "
              f"gone by uses {r['left_by_uses']}, age {r['age_mean']:.2f} mean, {r['age_max']} max"
              + (f"  {r['flag']}" if "flag" in r else ""))


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
            point = figures(results, args.target_frac, units)["arms"]
            best = min(point, key=lambda a: time_of(point[a]))
            pairs = [(best, a) for a in point if a != best]
            fig = figures(results, args.target_frac, units, pairs)["arms"][best]["vs"]
            ci = bootstrap(results, args.bootstrap, frac=args.target_frac, units=units, pairs=pairs)["arms"][best]["vs"]
            key = (lambda v: v["time_ratio"]) if basis == "measured" else (lambda v, u=basis: v["projected_ratio"][u])
            answer[basis] = {"fastest": best, "seconds": finite(time_of(point[best])),
                             "ratio_to": {a: [finite(key(fig[a])), *finite(key(ci[a]))] for a in fig}}
    else:
        answer = decide_points(s, cost)
    where = {"measured": "measured, on the machine that ran the comparison"}
    print(f"\nthe answer, for {whose(s)}:")
    for basis, ans in answer.items():
        label = where.get(basis, f"projected on {cost_path} ({basis} generation)")
        if ans["seconds"] is None:
            print(f"  {label}: no arm reached the target")
            continue
        others = ", ".join(f"{r[0]:.2f}x {a}'s time" + (f" [{fmt(r[1], '.2f')}, {fmt(r[2], '.2f')}]" if len(r) > 1 else "")
                           if r[0] else f"{a} did not reach it" for a, r in ans["ratio_to"].items())
        print(f"  {label}: {ans['fastest']} reaches the target first, in {ans['seconds']:.1f} s: {others}")
    return answer


def decide_points(s: dict, cost: dict | None) -> dict:
    """decide() for a summary without per-replicate runs: point figures from each arm's counts to the
    target (R from its flags; G from on_policy's, whose R = B), no intervals."""
    print(f"\nresults: {whose(s)}\n(no per-replicate runs in this summary: point figures, no intervals; re-run "
          f"compare.py for them)")
    flags = {arm: e["flags"].split() for arm, e in s["arms"].items()}
    size = lambda arm, flag: int(flags[arm][flags[arm].index(flag) + 1])
    G = size("on_policy", "--batch-size") // size("on_policy", "--prompts-per-round")
    sizes = {arm: (size(arm, "--prompts-per-round") * G, size(arm, "--batch-size")) for arm in s["arms"]}
    units = unit_costs(cost, sizes)
    times = {"measured": {a: e["seconds_to_target"] for a, e in s["arms"].items()}}
    for u, per_arm in units.items():
        times[u] = {a: None if e["generated_to_target"] is None else
                    e["generated_to_target"] / sizes[a][0] * per_arm[a][0] + e["trained_to_target"] / sizes[a][1] * per_arm[a][1]
                    for a, e in s["arms"].items()}
    answer = {}
    for basis, t in times.items():
        reached = {a: v for a, v in t.items() if v is not None}
        best = min(reached, key=reached.get, default=None)
        answer[basis] = {"fastest": best, "seconds": best and reached[best],
                         "ratio_to": {a: [reached[best] / v if v else 0.0] for a, v in t.items() if best and a != best}}
        print(f"{basis} seconds to target: " + ", ".join(f"{a} {fmt(v, '.1f')}" for a, v in t.items()))
    if cost:
        print(about_cost(cost))
    return answer


def plot(s: dict, path: str) -> None:
    """curves.png: each arm's accuracy against tokens, seconds and a projected cost (drawn by plot.py)."""
    from plot import plot_arms      # here, not at the top: this function's name would shadow the module
    if plot_arms(s, path) is not None:
        print(f"curves: {path}")


if __name__ == "__main__":
    main()
    sys.exit(0)
