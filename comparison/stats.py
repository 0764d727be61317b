"""The statistics of compare.py: a run's reach of the target (held, first touched, the fall after
it), the target itself, the figures of one set of replicates and their paired bootstrap intervals,
the verdicts in words, the choice of an lr, and time projected on a cost curve. compare.py's
docstring states the rules; this is their code. The standard library only.
"""
from __future__ import annotations

import json
import math
import random
import statistics


class CompareError(ValueError):
    """A setting or a run that the comparison cannot use; the message says what to change."""


X_KEYS = ("tokens", "seconds", "cpu_seconds", "rounds", "steps")          # where a run is, at an eval


# ---- reaching the target ----------------------------------------------------------------------
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


def area(run: dict) -> float:
    """A run's area under its accuracy against generated tokens, divided by the tokens: its mean
    accuracy over the tokens (trapezoids between its evals, from 0 to its last eval), which rewards
    learning early and holding it, without a target."""
    x, y = run["tokens"], run["accuracy"]
    trapezoids = ((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(x, x[1:], y, y[1:]))
    return math.fsum(trapezoids) / (x[-1] - x[0])


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
    """a / b of two amounts to the target (inf: not reached): inf when a is not reached, 0 when only b;
    b = 0 (reached at the start, 0 steps say): 1 if a is 0 too, else inf."""
    if math.isinf(a) or (b == 0 and a > 0):
        return math.inf
    return 0.0 if math.isinf(b) else 1.0 if b == 0 else a / b


def difference(a: float, b: float) -> float:
    """a - b of two figures that exist only where a run reached (inf: not reached): inf if either is."""
    return math.inf if math.isinf(a) or math.isinf(b) else a - b


def smaller_buffer_of(arm: str) -> str | None:
    """The arm that differs from this one by its buffer alone (the same S, B and uses, N halved), so
    that the paper's claim "a larger buffer learns more slowly but more stably" reads the one
    against the other, paired; None: no such arm."""
    return {"replay_big": "replay"}.get(arm)


def default_pairs(arms) -> list[tuple[str, str]]:
    """Every arm against on-policy, every replay arm against its control, and an arm with a larger
    buffer against the same arm with the smaller one (each when it ran)."""
    return ([(a, "on_policy") for a in arms if a != "on_policy"]
            + [(a, control_of(a)) for a in arms if control_of(a) in arms]
            + [(a, smaller_buffer_of(a)) for a in arms if smaller_buffer_of(a) in arms])


def figures(results: dict[str, list[dict]], frac: float = 1.0, units: dict | None = None,
            pairs: list[tuple[str, str]] | None = None, target: float | None = None) -> dict:
    """The figures of one set of replicates (results[arm][i]: replicate i, which starts from model i in
    every arm): the target (from on_policy), each arm's reach of it on its mean curve, held to the end
    (tokens, seconds, rounds, steps; inf: not reached), and first touched ("first": the mean over
    the replicates of each one's first reach, inf if one never reaches; "evals_in_rise": the median
    of their first reach's eval index, the evals the rise spans), its time projected on each cost curve
        projected = rounds to target x gen(R) + steps to target x train(B),
    its instability (the mean over replicates that reached of fall_after_reach; inf: none reached),
    final accuracy and entropy; and for each pair (arm, reference) the ratios arm / reference of
    tokens and measured seconds to hold and to first reach the target, of optimizer steps and CPU
    seconds to hold it, of projected seconds, and the accuracy, instability and entropy differences:
    out["arms"][arm]["vs"][reference]. Also each arm's area (the mean over its replicates of area())
    and, where every run has it, its entropy over the second half of the run ("entropy_half"), with
    their differences; and the ratio of CPU seconds to first reach. target: fixed before the runs
    (--target), the same in every draw; None: from on_policy and frac (target_accuracy)."""
    units = units or {}
    target = target_accuracy(results["on_policy"], frac) if target is None else target
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
                      "entropy": statistics.fmean(r["entropy"] for r in runs),
                      "area": math.fsum(area(r) for r in runs) / len(runs),
                      "cpu_known": all(not math.isnan(math.fsum(r.get("cpu_seconds", [math.nan])))
                                       for r in runs),
                      # NaN where a record has none (records before issue 52)
                      "entropy_half": statistics.fmean(r.get("entropy_half", math.nan)
                                                       for r in runs),
                      "vs": {}}
    for name, ref in default_pairs(results) if pairs is None else pairs:
        a, o = arms[name], arms[ref]
        a["vs"][ref] = {"token_ratio": ratio(a["tokens"], o["tokens"]), "time_ratio": ratio(a["seconds"], o["seconds"]),
                        "step_ratio": ratio(a["steps"], o["steps"]),
                        "cpu_time_ratio": ratio(a.get("cpu_seconds", math.nan), o.get("cpu_seconds", math.nan)),
                        "first_token_ratio": ratio(a["first"]["tokens"], o["first"]["tokens"]),
                        "first_time_ratio": ratio(a["first"]["seconds"], o["first"]["seconds"]),
                        "first_cpu_time_ratio": (
                            ratio(a["first"]["cpu_seconds"], o["first"]["cpu_seconds"])
                            if a["cpu_known"] and o["cpu_known"] else math.nan),
                        "projected_ratio": {c: ratio(a["projected"][c], o["projected"][c]) for c in units},
                        "accuracy_diff": a["final_accuracy"] - o["final_accuracy"],
                        "instability_diff": difference(a["instability"], o["instability"]),
                        "entropy_diff": a["entropy"] - o["entropy"],
                        "area_diff": a["area"] - o["area"],
                        "entropy_half_diff": a["entropy_half"] - o["entropy_half"]}
    return {"target": target, "arms": arms}


def intervals(draws: list) -> list | dict:
    """The 90% percentile interval [lo, hi] of every figure over the draws, nested as one draw is."""
    if isinstance(draws[0], dict):
        return {k: intervals([d[k] for d in draws]) for k in draws[0]}
    values = sorted(draws)
    n = len(values)
    return [values[int(0.05 * (n - 1))], values[int(math.ceil(0.95 * (n - 1)))]]


def bootstrap(results: dict[str, list[dict]], n: int, seed: int = 0, frac: float = 1.0, units: dict | None = None,
              pairs: list[tuple[str, str]] | None = None, target: float | None = None) -> dict:
    """90% intervals of figures(), resampling replicates with replacement. Replicate i of every arm
    starts from the same model with the same seed, so a draw takes the same replicates in every arm
    (replay i with control i and on-policy i): the target is recomputed and every ratio is taken
    within the draw, never as a ratio of two intervals (a target fixed before the runs stays as
    it is). Also each arm's not_reached_frac."""
    rng = random.Random(seed)
    k = len(results["on_policy"])
    draws = []
    for _ in range(n):
        idx = rng.choices(range(k), k=k)
        drawn = {a: [runs[i] for i in idx] for a, runs in results.items()}
        draws.append(figures(drawn, frac, units, pairs, target))
    out = intervals(draws)
    for a in results:
        out["arms"][a]["not_reached_frac"] = sum(math.isinf(d["arms"][a]["tokens"]) for d in draws) / n
    return out


# ---- the lr of each arm -----------------------------------------------------------------------
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


# ---- the verdicts, in words -------------------------------------------------------------------
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
    pairs += [(f"{a} / {e[key]['arm']}", e[key]) for a, e in s["arms"].items()
              for key in ("vs_control", "vs_smaller_buffer") if "verdict" in e.get(key, {})]
    return [f"{name}: says {e['verdict']!r}, its figures give {entry_verdict(e, rise)!r}"
            for name, e in pairs if e["verdict"] != entry_verdict(e, rise)]


# ---- the figures as summary.json keeps them ---------------------------------------------------
def finite(x):
    """JSON has no inf: None (not reached), also inside lists."""
    return [finite(v) for v in x] if isinstance(x, list) else None if math.isinf(x) else x


def pair_entry(point: dict, ci: dict) -> dict:
    """figures()'s ratios and differences of one pair, with their intervals, for summary.json."""
    return {"token_ratio": finite(point["token_ratio"]), "token_ratio_ci": finite(ci["token_ratio"]),
            "step_ratio": finite(point["step_ratio"]), "step_ratio_ci": finite(ci["step_ratio"]),
            "time_ratio": finite(point["time_ratio"]), "time_ratio_ci": finite(ci["time_ratio"]),
            **({"cpu_time_ratio": finite(point["cpu_time_ratio"]), "cpu_time_ratio_ci": finite(ci["cpu_time_ratio"])}
               if not math.isnan(point["cpu_time_ratio"]) else {}),
            "projected_time_ratio": {c: {"ratio": finite(v), "ci": finite(ci["projected_ratio"][c])}
                                     for c, v in point["projected_ratio"].items()},
            "first_reach_token_ratio": finite(point["first_token_ratio"]),
            "first_reach_token_ratio_ci": finite(ci["first_token_ratio"]),
            "first_reach_time_ratio": finite(point["first_time_ratio"]),
            "first_reach_time_ratio_ci": finite(ci["first_time_ratio"]),
            **({"first_reach_cpu_time_ratio": finite(point["first_cpu_time_ratio"]),
                "first_reach_cpu_time_ratio_ci": finite(ci["first_cpu_time_ratio"])}
               if not math.isnan(point["first_cpu_time_ratio"]) else {}),
            "accuracy_diff": point["accuracy_diff"], "accuracy_diff_ci": ci["accuracy_diff"],
            "area_diff": point["area_diff"], "area_diff_ci": ci["area_diff"],
            "instability_diff": finite(point["instability_diff"]), "instability_diff_ci": finite(ci["instability_diff"]),
            "entropy_diff": point["entropy_diff"], "entropy_diff_ci": ci["entropy_diff"],
            **({"entropy_half_diff": point["entropy_half_diff"],
                "entropy_half_diff_ci": ci["entropy_half_diff"]}
               if not math.isnan(point["entropy_half_diff"]) else {})}


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
