"""Issue 59, part 3: the decisive SmolLM2 comparison, pre-registered in
docs/plans/smollm2_decisive.md (committed before its first run). Does replay reach a fixed accuracy
with less generation than on-policy rounds, beyond chance, and is that reuse or only more steps?

    python comparison/compare_decisive.py --print          # the compare.py command, nothing run
    python comparison/compare_decisive.py                   # 6 seeds x 3 arms, two runs at a time
    python comparison/compare_decisive.py --seeds 10        # the plan's extension (its rule)
    python comparison/compare_decisive.py --verdict         # the plan's tests, from the records
    python comparison/compare_decisive.py --wall-clock      # the async pair, quiet cores (--verdict)
    python comparison/compare_decisive.py --checks          # issue 67's readings of the verdict

Synchronous loop only (deterministic: token figures need no quiet cores; one thread a run).
SmolLM2-135M-Instruct, --task sums, one prompt a round of G = 4 at T = 0.7, no zero-advantage
filter, lr 2.5e-4, 6,400 generated tokens (twice on-policy's mean tokens to first reach 0.45 in
the committed runs, 3,135), greedy evals on 100 fixed prompts every 800 tokens, RL seeds 100-105.
  on_policy  B = N = S = 16: a step once 16 new rollouts are in, each used once at age 0
  replay     B = N = 16, S = 8: a step per 8 new rollouts on the newest 16, each used twice (ages
             0-1); the loss docs/plans/smollm2_collapse.md's rule chose (LOSS below)
  control    B = N = S = 8: as many steps per generated token as replay, each rollout used once
Primary figure: per seed, log(replay's tokens to first reach 0.45 / on_policy's), a seed that never
reaches counted at the budget; one-sided paired t-test (H1: replay needs fewer), checked by the
exact sign-flip permutation test; beside it replay against control alike.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

RECORDS = "docs/results/records/smollm2_decisive"
LOSS = "ppo"            # the collapse plan's rule, from its verdict (results/smollm2_collapse.json)
FIRST_SEED, SEEDS, MORE_SEEDS = 100, 6, 10
BUDGET, EVERY, TARGET = 6400, 800, 0.45
SD_TO_EXTEND = 0.34     # the observed sd of the primary log ratio above which the plan goes to 10
SHARED = "--prompts-per-round 1 --no-skip-zero-advantage"
ARMS = {"on_policy": "--batch-size 16 --buffer-size 16 --new-per-update 16",
        "replay": f"--batch-size 16 --buffer-size 16 --new-per-update 8 --loss {LOSS}",
        "control": "--batch-size 8 --buffer-size 8 --new-per-update 8"}
PAIRS = (("replay", "on_policy"), ("replay", "control"), ("control", "on_policy"))
MU = {"measured": None, "paper_5": 5.0, "paper_7": 7.0}   # generation / training cost per rollout
SEEDS_AT_MOST = 500     # the seeds a 90%-power test would need: None above this


def compare_argv(seeds: int = SEEDS, arms: dict = ARMS, records: str = RECORDS,
                 output_dir: str = "runs/smollm2_decisive", jobs: int = 2) -> list[str]:
    argv = ["--model", "smollm2", "--task", "sums", "--num-generations", "4", "--batch-size", "16",
            "--lr", "2.5e-4", "--first-seed", str(FIRST_SEED), "--seeds", str(seeds),
            "--budget-tokens", str(BUDGET), "--evals", str(BUDGET // EVERY), "--eval-prompts",
            "100", "--target", str(TARGET), "--target-rule", "first",
            "--train-args", "--temperature 0.7", "--arms", *arms]
    for name, flags in arms.items():
        argv += ["--arm", name, f"{SHARED} {flags}"]
    pairs = [f"{a}:{b}" for a, b in PAIRS if b != "on_policy" and a in arms and b in arms]
    return argv + (["--pairs", *pairs] if pairs else []) + [
        "--jobs", str(jobs), "--records", records, "--output-dir", output_dir]


# ---- the wall-clock pair (the plan's last section): async, quiet cores, one run at a time --------
# Both arms are the synchronous ones above with one generation worker (--generators 1): the worker
# and the trainer one thread each (infra/workers.threads_each), so both arms have the same two
# cores; the worker is held while the trainer evaluates (the fair clocks). compare.py reads every
# arm against one named on_policy: here that is the async on-policy arm.
WALL_RECORDS = "docs/results/records/smollm2_decisive_wall"
WALL_ARMS = {"on_policy": f"--generators 1 {ARMS['on_policy']}",
             "async_replay": f"--generators 1 {ARMS['replay']}"}
BUSY_AT_MOST = 0.15     # the machine's busy share of its cores, sampled before the runs


def busy_share(seconds: float = 3.0) -> float:
    """The share of the machine's CPU time not idle over a few seconds (/proc/stat): what else runs
    on the cores. A wall-clock figure counts only from quiet cores."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]                  # total, idle + iowait
    import time
    (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def wall_verdict(all_curves: dict) -> dict:
    """The plan's wall-clock test: per seed, log(async_replay's wall seconds to first reach 0.45 /
    async on-policy's), a seed that never reaches counted at its last eval's seconds; one-sided
    paired t at alpha 0.05, the sign-flip p beside it; each run's CPU / wall (two processes of one
    thread: at most 2)."""
    seeds = sorted(set.intersection(*(set(c) for c in all_curves.values())))
    reach, cpu_per_wall = {}, {}
    for arm, runs in all_curves.items():
        reach[arm], cpu_per_wall[arm] = {}, {}
        for s in seeds:
            curve = runs[s]
            reach[arm][s] = {**first_reach(curve), "seconds": seconds_at(curve)}
            last = curve["record"]["evals"][-1]
            cpu_per_wall[arm][s] = ((last["gen_cpu_seconds"] + last["train_cpu_seconds"])
                                    / last["wall_seconds"])
    out = {"seeds": seeds, "target": TARGET, "budget_tokens": BUDGET,
           "reached": {a: sum(r["reached"] for r in reach[a].values()) for a in reach},
           "seconds_to_first_reach": {a: [reach[a][s]["seconds"] for s in seeds] for a in reach},
           "cpu_per_wall": {a: [cpu_per_wall[a][s] for s in seeds] for a in reach}}
    if len(seeds) >= 2:
        test = paired_test([math.log(reach["async_replay"][s]["seconds"]
                                     / reach["on_policy"][s]["seconds"]) for s in seeds])
        lo, hi = test["interval_90"]
        out["async_replay/on_policy"] = {
            "log_seconds_ratio": test, "seconds_ratio": math.exp(test["mean"]),
            "seconds_ratio_90": [math.exp(lo), math.exp(hi)],
            "saving_detected": test["p_t"] < 0.05 and test["p_permutation"] < 0.05}
    return out


def seconds_at(curve: dict) -> float:
    """Wall seconds (evals excluded) at a first reach: interpolated as its tokens are; never
    reached: the last eval's."""
    import stats
    hit = stats.first_reach_point(curve, TARGET)
    return curve["seconds"][-1] if hit is None else hit["seconds"]


# ---- the plan's tests ----------------------------------------------------------------------------
def paired_test(d: list[float], permutation: bool = True) -> dict:
    """One-sided paired t-test of mean(d) < 0, the exact sign-flip permutation p beside it, and the
    90% t-interval of the mean (two-sided: each end a one-sided 95% bound). The sign-flip test
    enumerates 2^n flips: permutation=False leaves it out (p_permutation None), for many seeds."""
    from power import t_cdf, t_quantile
    n, mean = len(d), statistics.fmean(d)
    sd = statistics.stdev(d) if n > 1 else math.nan
    se = sd / math.sqrt(n)
    t = mean / se if se > 0 else (-math.inf if mean < 0 else math.inf if mean > 0 else 0.0)
    flips = [sum(x if (mask >> i) & 1 else -x for i, x in enumerate(d))
             for mask in range(2 ** n)] if permutation else None
    total = sum(d)
    half, half_95 = t_quantile(0.95, n - 1) * se, t_quantile(0.975, n - 1) * se
    return {"n": n, "mean": mean, "sd": sd, "t": t, "p_t": t_cdf(t, n - 1),
            "p_permutation": (sum(f <= total + 1e-12 for f in flips) / len(flips)
                              if permutation else None),
            "interval_90": [mean - half, mean + half],
            "interval_95": [mean - half_95, mean + half_95], "values": d}


def first_reach(curve: dict) -> dict:
    """Tokens, rounds and steps to the first eval at or above TARGET (interpolated as compare.py
    does); never: the budget's (the run's last eval), marked."""
    import stats
    point = stats.first_reach_point(curve, TARGET)
    if point is None:
        return {"tokens": float(BUDGET), "rounds": curve["rounds"][-1], "steps": curve["steps"][-1],
                "reached": False}
    return {**{k: point[k] for k in ("tokens", "rounds", "steps")}, "reached": True}


def curves(records: str = RECORDS, arms: dict = ARMS) -> dict[str, dict[int, dict]]:
    """{arm: {seed: its curve at the plan's eval grid}} of the records there are."""
    import records as rec
    grid = [EVERY * k for k in range(BUDGET // EVERY + 1)]
    out = {}
    for arm in arms:
        out[arm] = {}
        for path in sorted(glob.glob(os.path.join(ROOT, records, arm, "seed*-*.json"))):
            record = json.load(open(path))
            out[arm][record["config"]["seed"]] = {**rec.read_record(record, grid, path),
                                                  "record": record}
    return out


def compute_to_target(reach: dict, arm: str, mu: float) -> float:
    """Generation + training to the first reach, in units of training one rollout: rollouts
    generated (rounds x P x G = 4 a round) x mu + rollouts trained (steps x B)."""
    B = 8 if arm == "control" else 16
    return reach["rounds"] * 4 * mu + reach["steps"] * B


def measured_mu(all_curves: dict) -> float:
    """Generation / training seconds per rollout over the on-policy runs (their records)."""
    gen = train = generated = trained = 0.0
    for curve in all_curves["on_policy"].values():
        r = curve["record"]
        gen += r["last"]["gen_seconds"]
        train += r["last"]["train_seconds"]
        generated += r["rounds"]["generated"]
        trained += r["rounds"]["steps"] * 16
    return (gen / generated) / (train / trained)


def look_alpha(n: int, sd: float) -> float:
    """The plan's looks: at 6 seeds with the primary figure's sd at most 0.34, one look at 0.05;
    else each look (6 seeds, then 10) at 0.025."""
    return 0.05 if n < MORE_SEEDS and sd <= SD_TO_EXTEND else 0.025


SEEDS_RULE = ("the fewest seeds whose one-sided paired t-test at this look's alpha has power 0.9 "
              "at the observed sd, computed exactly (power.exact_seeds_needed: the noncentral t), "
              "for a 40% saving (tokens and compute) or the observed mean (steps, area, entropy); "
              f"null: more than {SEEDS_AT_MOST}")


def verdict(all_curves: dict) -> dict:
    """The plan's tests on the seeds every arm has: tokens (and steps) to first reach 0.45, the mean
    accuracy over the evals, the second half's entropy and the compute to the target, per pair;
    the look's alpha by the plan's rule."""
    from power import exact_seeds_needed
    seeds = sorted(set.intersection(*(set(c) for c in all_curves.values())))
    reach = {arm: {s: first_reach(all_curves[arm][s]) for s in seeds} for arm in ARMS}
    out = {"seeds": seeds, "target": TARGET, "budget_tokens": BUDGET,
           "reached": {arm: sum(r["reached"] for r in reach[arm].values()) for arm in ARMS},
           "mean_tokens_to_first_reach": {
               arm: statistics.fmean(r["tokens"] for r in reach[arm].values()) for arm in ARMS},
           "pairs": {}}
    if len(seeds) < 2:
        return out
    mus = {**MU, "measured": measured_mu(all_curves)}
    first = paired_test([math.log(reach["replay"][s]["tokens"] / reach["on_policy"][s]["tokens"])
                         for s in seeds])
    alpha = look_alpha(len(seeds), first["sd"])
    out.update(look=f"{len(seeds)} seeds ({seeds[0]}-{seeds[-1]})", alpha_this_look=alpha,
               seeds_for_90pct_power_rule=SEEDS_RULE)

    def need(effect: float) -> int | None:
        return exact_seeds_needed(effect, 0.9, alpha, SEEDS_AT_MOST)
    for a, b in PAIRS:
        tokens = paired_test([math.log(reach[a][s]["tokens"] / reach[b][s]["tokens"])
                              for s in seeds])
        area = paired_test([statistics.fmean(all_curves[a][s]["accuracy"])
                            - statistics.fmean(all_curves[b][s]["accuracy"]) for s in seeds])
        entropy = paired_test([all_curves[a][s]["record"]["entropy_second_half"]
                               - all_curves[b][s]["record"]["entropy_second_half"] for s in seeds])
        steps = paired_test([math.log(reach[a][s]["steps"] / reach[b][s]["steps"]) for s in seeds])
        rounds = paired_test([math.log(reach[a][s]["rounds"] / reach[b][s]["rounds"])
                              for s in seeds])      # rollouts generated: 4 a round in every arm
        compute = {name: paired_test([math.log(compute_to_target(reach[a][s], a, mu)
                                               / compute_to_target(reach[b][s], b, mu))
                                      for s in seeds]) for name, mu in mus.items()}
        for fig in (tokens, *compute.values()):             # SEEDS_RULE
            fig["seeds_for_90pct_power"] = need(-math.log(0.6) / fig["sd"])
        for fig in (steps, area, entropy):
            fig["seeds_for_90pct_power"] = need(abs(fig["mean"]) / fig["sd"])
        lo, hi = tokens["interval_90"]
        out["pairs"][f"{a}/{b}"] = {
            "log_token_ratio": tokens, "token_ratio": math.exp(tokens["mean"]),
            "token_ratio_90": [math.exp(lo), math.exp(hi)],
            "token_ratio_95": [math.exp(x) for x in tokens["interval_95"]],
            "saving_detected": tokens["p_t"] < alpha and tokens["p_permutation"] < alpha,
            "saving_of_40pct_excluded": lo > math.log(0.6),
            "log_round_ratio": rounds, "log_step_ratio": steps, "step_ratio": math.exp(steps["mean"]),
            "step_ratio_90": [math.exp(x) for x in steps["interval_90"]],
            "area_difference": area, "entropy_second_half_difference": entropy,
            "log_compute_ratio": compute, "mu": mus}
    out["extend_to_10"] = (len(seeds) < MORE_SEEDS and first["sd"] > SD_TO_EXTEND
                           and not out["pairs"]["replay/on_policy"]["saving_detected"])
    return out


def checks(all_curves: dict, wall_curves: dict) -> dict:
    """Issue 67's readings of the verdict, from the same records: the look's exact power to detect a
    25% and a 40% saving at its alpha and at 0.05 (the observed sd); how far the 40% exclusion
    leans on the rule for runs that never reach (the tokens at which on-policy's non-reaching runs,
    counted there instead of at the budget, would bring the 90% interval's low end down to 0.60);
    and the mean age of the rollouts each arm trained on, per run, synchronous and wall-clock."""
    from power import exact_power
    v = verdict(all_curves)
    fig, alpha = v["pairs"]["replay/on_policy"]["log_token_ratio"], v["alpha_this_look"]
    n, sd = fig["n"], fig["sd"]
    seeds = v["seeds"]
    replay = [first_reach(all_curves["replay"][s])["tokens"] for s in seeds]
    reach = [first_reach(all_curves["on_policy"][s]) for s in seeds]
    never = [s for s, r in zip(seeds, reach) if not r["reached"]]

    def low_end(tokens: float) -> float:
        on = [r["tokens"] if r["reached"] else tokens for r in reach]
        return paired_test([math.log(a / b) for a, b in zip(replay, on)])["interval_90"][0]
    lo, hi = float(BUDGET), 100.0 * BUDGET
    if low_end(lo) > math.log(0.6) > low_end(hi):
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if low_end(mid) > math.log(0.6) else (lo, mid)
    ages = lambda runs: {a: [runs[a][s]["record"]["reuse"]["age_mean"] for s in sorted(runs[a])]
                         for a in runs}                                        # noqa: E731
    return {"seeds": seeds, "alpha_this_look": alpha, "sd": sd,
            "power": {f"saving_{round(100 * sv)}pct": {
                "at_look_alpha": exact_power(n, -math.log(1 - sv) / sd, alpha),
                "at_0.05": exact_power(n, -math.log(1 - sv) / sd, 0.05)} for sv in (0.25, 0.4)},
            "exclusion_of_40pct": {
                "low_end_90": math.exp(fig["interval_90"][0]),
                "low_end_95": math.exp(fig["interval_95"][0]), "on_policy_never_reached": never,
                "fails_from_tokens": (lo + hi) / 2 if never else None},
            "age_mean": {"synchronous": ages(all_curves), "wall_clock": ages(wall_curves)}}


def main(argv=None):
    p = argparse.ArgumentParser(prog="compare_decisive.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print", action="store_true", help="print the command and run nothing")
    p.add_argument("--verdict", action="store_true", help="the plan's tests from the records")
    p.add_argument("--seeds", type=int, default=SEEDS, choices=(SEEDS, MORE_SEEDS),
                   help="6, or 10 when the plan's rule extends it")
    p.add_argument("--checks", action="store_true",
                   help="issue 67's readings of the verdict (checks()), from the records")
    p.add_argument("--wall-clock", action="store_true",
                   help="the plan's wall-clock pair (async, seeds 100-105, one run at a time; it "
                        "refuses to start on busy cores); with --verdict, its test")
    args = p.parse_args(argv)
    if args.wall_clock and args.seeds != SEEDS:
        p.error(f"--wall-clock with --seeds {args.seeds}: the wall-clock pair has the plan's "
                f"{SEEDS} seeds")
    if args.checks:
        result = checks(curves(), curves(WALL_RECORDS, WALL_ARMS))
        print(json.dumps(result, indent=1))
        return result
    if args.verdict:
        result = (wall_verdict(curves(WALL_RECORDS, WALL_ARMS)) if args.wall_clock
                  else verdict(curves()))
        print(json.dumps(result, indent=1, default=lambda x: None))
        return result
    import compare
    if not args.wall_clock:
        return compare.print_or_run(compare_argv(args.seeds), args.print)
    argv = compare_argv(SEEDS, WALL_ARMS, WALL_RECORDS, "runs/smollm2_decisive_wall", jobs=1)
    if not args.print and (busy := busy_share()) > BUSY_AT_MOST:
        p.error(f"the cores are {busy:.0%} busy: a wall-clock figure counts only from quiet "
                "cores; stop what else runs and start it again")
    return compare.print_or_run(argv, args.print)


if __name__ == "__main__":
    main()
