"""The summary of a comparison, summary.json: summarize() turns the arms' runs into it (the target,
each arm's figures with their intervals, its curves and replicates, each pair's ratios and verdict,
and the rules every figure follows, in words), for compare.py after its runs and again when it
reads a summary (--summary). stats.py computes the figures; this file lays them out by arm.
"""
from __future__ import annotations

import math
import statistics

from records import arm_flags_of, discards_possible, flags_differ
from stats import (RISE_EVALS, X_KEYS, bootstrap, control_of, default_pairs, entry_verdict, figures,
                   final_accuracy, finite, mean_curve, measured_reuse, pair_entry, reach_point,
                   share_units, smaller_buffer_of, unit_costs)

TARGET_RULES = {
    "hold": "the arm's mean curve reaches the target at the first eval from which the median of "
            "each eval and its two neighbours stays >= target to the end (tokens_to_target, "
            "token_ratio)",
    "first": "each replicate's first eval >= target, raw, interpolated; the arm's figure the mean "
             "over its replicates, paired per replicate (tokens_to_first_reach, "
             "first_reach_token_ratio)"}


def read_pairs(results: dict, extra: list[str]) -> list[tuple[str, str]]:
    """The pairs a summary reads: every arm against on_policy, each replay arm against its control,
    a larger buffer against the smaller (stats.default_pairs), and --pairs ARM:REFERENCE."""
    pairs = default_pairs(results)
    return pairs + [p for p in (tuple(x.split(":")) for x in extra) if p not in pairs]


def counted_rounds(counts: list[dict]) -> dict:
    """An arm's rounds as its records counted them (records.round_counts), summed over its
    replicates, with each replicate's discarded rollouts and empty rounds."""
    return {**{k: sum(c[k] for c in counts) for k in counts[0]},
            "discarded_per_replicate": [c["discarded"] for c in counts],
            "empty_rounds_per_replicate": [c["empty_rounds"] for c in counts]}


def summarize(results: dict[str, list[dict]], args, grid: list[float], lrs: dict,
              cost: dict | None = None) -> dict:
    """summary.json of the arms' runs (results: arm -> its replicates, as records.read_record
    gives them), read with compare.py's settings (args), on the eval grid, at the lrs run."""
    op = results["on_policy"]
    # the cost ratio, measured on the on-policy arm: seconds per generated / per trained rollout
    cost_ratio = statistics.median((r["gen_seconds"] / r["rollouts_generated"])
                                   / (r["train_seconds"] / r["rollouts_trained"])
                                   for r in op)
    sizes = {arm: (runs[0]["R"], runs[0]["B"]) for arm, runs in results.items()}
    curve_units = unit_costs(cost, sizes)
    units = {**curve_units, **share_units(op, sizes, getattr(args, "gen_shares", []))}
    fixed = getattr(args, "target", None)                 # summaries before --target: None
    pairs = read_pairs(results, getattr(args, "pairs", []))
    fig = figures(results, args.target_frac, units, pairs, fixed)
    ci = bootstrap(results, args.bootstrap, frac=args.target_frac, units=units, pairs=pairs,
                   target=fixed)
    target = fig["target"]
    if args.model == "tiny" and not args.one_model:
        replicates = "warm-start seed i and RL seed i: the model varies"
    else:
        model = 'tiny, warm-start seed 0' if args.model == 'tiny' else args.model
        replicates = f"one model ({model}), RL seed i"
    if getattr(args, "first_seed", 0):
        replicates += f" (i from {args.first_seed})"
    summary = {"task": args.task, "model": args.model, "train_args": args.train_args,
               "target_accuracy": target, "target_accuracy_ci": ci["target"],
               "target_frac": args.target_frac,
               "target_fixed": fixed is not None, "target_rules": TARGET_RULES,
               "target_rule": getattr(args, "target_rule", "hold"),
               "cost_ratio": cost_ratio, "budget_tokens": args.budget_tokens, "grid_tokens": grid,
               "lr": lrs,
               "lr_chosen_by": "sweep" if args.sweep_lr else "given",
               "seconds_measured": f"generation + training (evals excluded), {args.jobs} run(s) "
                                   "side by side, " + threads_in_words(getattr(args, "threads", 1)),
               "reach_rule": "first eval from which the median of each eval and its two neighbours "
                             "stays >= target; the crossing interpolated linearly between the eval "
                             "before and that one (tokens, seconds, rounds and steps alike)",
               "first_reach_rule": "per replicate, the first eval >= target (raw, not smoothed), "
                                   "held or not, interpolated alike in the raw accuracy; the arm's "
                                   "figure: the mean over its replicates (not reached if one never "
                                   "reaches); evals in the rise: the median of their first reach's "
                                   "eval index",
               "instability_rule": "per replicate that first reaches the target: target - its "
                                   "lowest eval from there on (0 if none is below); the arm's "
                                   "figure: the mean over those replicates",
               "replicates": replicates,
               "intervals": f"90% bootstrap over replicates: each draw takes replicate i of every "
                            f"arm together (one starting model), recomputes the target, and takes "
                            f"every ratio within the draw ({args.bootstrap} resamples)",
               "cost": cost and {k: cost[k] for k in ("file", "about", "interpolation")}
                       | {"curves": list(curve_units)},
               "gen_share_projection": getattr(args, "gen_shares", None) and (
                   "projected, not measured: seconds to the target with each run's rounds charged "
                   "at the on-policy runs' measured seconds per generated rollout and its steps at "
                   "their seconds per trained one, training scaled so that an on-policy run spends "
                   "the share given generating (a GPU's: docs/gpu.md measured 86-96%)"),
               "args": vars(args), "arms": {}}
    # how finely the evals resolve the rise: the evals from the start to each arm's first reach
    evals = {a: finite(f["evals_in_rise"]) for a, f in fig["arms"].items()}
    fastest = min((a for a in evals if evals[a] is not None),
                  key=lambda a: fig["arms"][a]["first"]["tokens"],
                  default=None)         # None: in every arm some replicate never touched the target
    rise = {"evals_in_rise": evals, "fastest_arm": fastest,
            "fastest_evals": evals[fastest] if fastest else None,
            "needed": RISE_EVALS, "resolved": fastest is not None and evals[fastest] >= RISE_EVALS}
    summary["rise"] = rise
    for name, runs in results.items():
        f, c = fig["arms"][name], ci["arms"][name]
        R, B = sizes[name]
        curve = mean_curve(runs)
        accs = [r["accuracy"] for r in runs]
        entry = {
            "R": R, "B": B, "final_accuracy": f["final_accuracy"],
            "final_accuracy_range": [min(final_accuracy(a) for a in accs),
                                     max(final_accuracy(a) for a in accs)],
            **{f"{k}_to_target": finite(f[k]) for k in X_KEYS if k in f},
            **{f"{k}_to_target_ci": finite(c[k]) for k in X_KEYS if k in c},
            "generated_to_target": finite(f["rounds"] * R),
            "trained_to_target": finite(f["steps"] * B),
            **{f"{k}_to_first_reach": finite(f["first"][k]) for k in ("tokens", "seconds")},
            **{f"{k}_to_first_reach_ci": finite(c["first"][k]) for k in ("tokens", "seconds")},
            "evals_in_rise": finite(f["evals_in_rise"]),
            "instability": finite(f["instability"]), "instability_ci": finite(c["instability"]),
            "projected_seconds_to_target": {u: {"seconds": finite(v),
                                                "ci": finite(c["projected"][u])}
                                            for u, v in f["projected"].items()},
            "not_reached_frac": c["not_reached_frac"],
            "entropy": f["entropy"], "seeds": len(runs),
            # mean over the replicates of each run's mean over its steps (largest: over every step)
            **({"truncated_frac": statistics.fmean(r["truncated_frac"] for r in runs),
                "truncated_frac_max": max(r["truncated_frac_max"] for r in runs),
                "age_mean": statistics.fmean(r["age_mean"] for r in runs),
                "age_max": max(r["age_max"] for r in runs)}
               if all("age_mean" in r for r in runs) else {}),
            **({"is_ratio_mean": statistics.fmean(r["is_ratio_mean"] for r in runs),
                "is_ratio_max": max(r["is_ratio_max"] for r in runs)}
               if all("is_ratio_mean" in r for r in runs) else {}),
            "gen_seconds": statistics.fmean(r["gen_seconds"] for r in runs),
            "train_seconds": statistics.fmean(r["train_seconds"] for r in runs),
            "flags": " ".join(arm_flags_of(args, name)),
            "curve": {**curve, "min": [min(a[j] for a in accs) for j in range(len(grid))],
                      "max": [max(a[j] for a in accs) for j in range(len(grid))],
                      "projected": {u: [r * g + s * t
                                        for r, s in zip(curve["rounds"], curve["steps"])]
                                    for u, (g, t) in ((u, units[u][name]) for u in units)}},
            # each replicate's own run and its own reach of the (mean curve's) target
            "replicates": [{**run, "reach": reach_point(run, target)} for run in runs],
        }
        # records from before the CPU seconds were kept: none of their figures
        if any(math.isnan(x) for r in runs for x in r.get("cpu_seconds", [math.nan])):
            entry = {k: v for k, v in entry.items() if not k.startswith("cpu_seconds")}
            entry["curve"].pop("cpu_seconds", None)
            entry["replicates"] = [{k: v for k, v in r.items() if k != "cpu_seconds"}
                                   for r in entry["replicates"]]
            entry["replicates"] = [{**r, "reach": r["reach"] and {
                k: v for k, v in r["reach"].items() if k != "cpu_seconds"}}
                for r in entry["replicates"]]
        if all("reuse" in r for r in runs):
            entry["reuse"] = measured_reuse(name, [r["reuse"] for r in runs])
        entry["area"], entry["area_ci"] = f["area"], c["area"]
        if not math.isnan(f["entropy_half"]):
            entry["entropy_half"], entry["entropy_half_ci"] = f["entropy_half"], c["entropy_half"]
        if f["cpu_known"]:
            entry["cpu_seconds_to_first_reach"] = finite(f["first"]["cpu_seconds"])
            entry["cpu_seconds_to_first_reach_ci"] = finite(c["first"]["cpu_seconds"])
        entry["discards_possible"] = discards_possible(
            arm_flags_of(args, name) + ["--num-generations", str(args.num_generations)])
        if all("rounds_counted" in r for r in runs):
            entry["rounds"] = counted_rounds([r["rounds_counted"] for r in runs])
        for ref, point in f["vs"].items():
            pair = pair_entry(point, c["vs"][ref])
            pair["verdict"] = entry_verdict(pair, rise["fastest_evals"])
            pair["differs"] = flags_differ(arm_flags_of(args, name), arm_flags_of(args, ref))
            if ref == "on_policy":
                entry.update(pair)
            elif ref == smaller_buffer_of(name):
                entry["vs_smaller_buffer"] = {"arm": ref, **pair}
            elif ref == control_of(name):
                entry["vs_control"] = {"arm": ref, **pair}
            else:
                entry.setdefault("vs_other", {})[ref] = pair
        summary["arms"][name] = entry
    others = {a: e for a, e in summary["arms"].items()
              if not a.startswith(("on_policy", "control"))}
    reached = {a: e for a, e in others.items() if e["token_ratio"] is not None}
    best = min(reached, key=lambda a: reached[a]["token_ratio"], default=None)
    summary["best_replay_arm"] = best
    for key in ("token_ratio", "time_ratio", "projected_time_ratio"):
        summary[key] = summary["arms"][best][key] if best else None
    return summary


def threads_in_words(threads: int) -> str:
    """How many torch threads each synchronous run had (an async run's processes: their share)."""
    return "one torch thread each" if threads == 1 else f"{threads} torch threads each"
