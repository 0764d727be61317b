"""Issue 67: the confirmatory SmolLM2 comparison, pre-registered in
docs/plans/smollm2_confirmatory.md (committed before its first run). The decisive comparison's
replay and on-policy arms, as they ran, on 18 fresh seeds (200-217): enough for 90% power to
detect a 25% saving of generated tokens with a one-sided paired t-test at 0.05, at the decisive
look's observed sd (0.398). One look.

    python comparison/compare_confirm.py --print        # the compare.py command, nothing run
    python comparison/compare_confirm.py                # 18 seeds x 2 arms, two runs at a time
    python comparison/compare_confirm.py --verdict      # the plan's test, from the records
    python comparison/compare_confirm.py --seeds-needed # how the 18 were computed

Primary figure (the decisive one, unchanged): per seed, log(replay's generated tokens to first reach
0.45 / on-policy's), a run that never reaches counted at the budget (6,400 tokens); the one-sided
paired t-test at 0.05 and the exact sign-flip test beside it. The verdict is one of three (four
with both): a saving detected (both p below 0.05); a 25% saving excluded (the 90% interval's low
end above log 0.75); neither, with the seeds a 90%-power test would need at the observed sd.
Sensitivity: the same test with every non-reaching run counted at twice the budget.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compare_decisive as decisive  # noqa: E402

RECORDS = "docs/results/records/smollm2_confirmatory"
FIRST_SEED, SEEDS = 200, 18
ARMS = {arm: decisive.ARMS[arm] for arm in ("on_policy", "replay")}
ALPHA, SAVING, POWER = 0.05, 0.25, 0.9
SD_PLANNED = 0.3981461232210191     # the decisive look's sd (docs/results/smollm2_decisive.json)
SENSITIVITY_FACTOR = 2              # non-reaching runs at this many budgets in the sensitivity line


def compare_argv(jobs: int = 2) -> list[str]:
    argv = decisive.compare_argv(SEEDS, ARMS, RECORDS, "runs/smollm2_confirmatory", jobs)
    return [str(FIRST_SEED) if i and argv[i - 1] == "--first-seed" else x
            for i, x in enumerate(argv)]


def seeds_needed(sd: float = SD_PLANNED, saving: float = SAVING, alpha: float = ALPHA,
                 power: float = POWER) -> int | None:
    """The fewest seeds whose one-sided paired t-test at alpha detects log(1 - saving) with the
    power asked, at this sd: exact (power.exact_power, the noncentral t), not simulated."""
    from power import exact_seeds_needed
    return exact_seeds_needed(-math.log(1 - saving) / sd, power, alpha)


def tokens_to_target(curve: dict, never: float) -> tuple[float, bool]:
    """Generated tokens to the first eval at or above the target (interpolated), and whether it was
    reached; a run that never reaches it counted at `never` tokens."""
    reach = decisive.first_reach(curve)
    return (reach["tokens"] if reach["reached"] else never), reach["reached"]


def test(all_curves: dict, seeds: list[int], never: float) -> dict:
    """The plan's test of replay / on_policy's log token ratio, non-reaching runs at `never`."""
    d = [math.log(tokens_to_target(all_curves["replay"][s], never)[0]
                  / tokens_to_target(all_curves["on_policy"][s], never)[0]) for s in seeds]
    t = decisive.paired_test(d)
    lo, hi = t["interval_90"]
    detected = t["p_t"] < ALPHA and t["p_permutation"] < ALPHA
    excluded = lo > math.log(1 - SAVING)
    words = ("a saving detected" + (f", and a {SAVING:.0%} saving excluded" if excluded else "")
             if detected else f"a {SAVING:.0%} saving excluded (no saving detected)" if excluded
             else "neither a saving detected nor a 25% saving excluded")
    return {"log_token_ratio": t, "token_ratio": math.exp(t["mean"]),
            "token_ratio_90": [math.exp(lo), math.exp(hi)], "saving_detected": detected,
            f"saving_of_{round(SAVING * 100)}pct_excluded": excluded, "verdict": words,
            "seeds_for_90pct_power": seeds_needed(t["sd"]) if t["n"] > 1 else None,
            "power_25pct_at_observed_sd": power_at(t["n"], t["sd"]) if t["n"] > 1 else None}


def power_at(n: int, sd: float, saving: float = SAVING, alpha: float = ALPHA) -> float:
    """The power this look had to detect log(1 - saving) at the observed sd (the plan: the page
    states it afterwards), exact as seeds_needed's."""
    from power import exact_power
    return exact_power(n, -math.log(1 - saving) / sd, alpha)


def verdict(all_curves: dict) -> dict:
    """The plan's one look: the primary test on the seeds both arms have, the sensitivity line,
    how many runs of each arm never reached the target."""
    seeds = sorted(set(all_curves["replay"]) & set(all_curves["on_policy"]))
    out = {"seeds": seeds, "planned_seeds": list(range(FIRST_SEED, FIRST_SEED + SEEDS)),
           "complete": seeds == list(range(FIRST_SEED, FIRST_SEED + SEEDS)),
           "target": decisive.TARGET, "budget_tokens": decisive.BUDGET, "alpha": ALPHA,
           "reached": {arm: sum(tokens_to_target(all_curves[arm][s], 0)[1] for s in seeds)
                       for arm in ARMS}}
    if len(seeds) < 2:
        return out
    out["primary"] = test(all_curves, seeds, float(decisive.BUDGET))
    out["sensitivity"] = {"non_reaching_at_tokens": SENSITIVITY_FACTOR * decisive.BUDGET,
                          **test(all_curves, seeds, float(SENSITIVITY_FACTOR * decisive.BUDGET))}
    out["sensitivity"]["same_verdict"] = (out["sensitivity"]["verdict"]
                                          == out["primary"]["verdict"])
    out["mean_tokens_to_first_reach"] = {
        arm: statistics.fmean(tokens_to_target(all_curves[arm][s], decisive.BUDGET)[0]
                              for s in seeds) for arm in ARMS}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="compare_confirm.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print", action="store_true", help="print the command and run nothing")
    p.add_argument("--verdict", action="store_true", help="the plan's test from the records")
    p.add_argument("--seeds-needed", action="store_true",
                   help="the seed count's computation (exact noncentral t), at 0.05 and 0.025")
    args = p.parse_args(argv)
    if args.seeds_needed:
        out = {"sd": SD_PLANNED, "saving": SAVING, "power": POWER,
               "seeds_at_0.05": seeds_needed(), "seeds_at_0.025": seeds_needed(alpha=0.025)}
        print(json.dumps(out, indent=1))
        return out
    if args.verdict:
        result = verdict(decisive.curves(RECORDS, ARMS))
        print(json.dumps(result, indent=1, default=lambda x: None))
        return result
    import compare
    return compare.print_or_run(compare_argv(), args.print)


if __name__ == "__main__":
    main()
