"""Issue 67, part 3: holding the target. Per arm of a pre-registered SmolLM2 comparison, the peak
accuracy, the final accuracy, and how many runs that reached 0.45 later fell below 0.30 (the paper:
aggressive replay lowers peak accuracy); between arms, paired by seed, the differences.

    python comparison/holding.py                              # the decisive comparison's 3 arms
    python comparison/holding.py --comparison confirmatory    # its 2 arms, once its records are in

Each writes docs/results/smollm2_<comparison>_holding.json (runs nothing); holding.table() is the
page's table of it (docs/results.md).

A run's evals are those of its record at the plan's grid (0, 800, ..., 6,400 generated tokens):
  peak: its highest eval after the start;  final: its last eval, at the budget (6,400 tokens);
  reached: an eval at or above 0.45;  fell: reached, and an eval after the first such below 0.30
    (its lowest eval from there on is kept).
Means over seeds with their 90% t-interval (two-sided; each end a one-sided 0.05 bound); counts k
of n with the exact Clopper-Pearson 90% interval of the proportion (each tail 0.05); between two
arms, the paired difference of peak and of final (compare_decisive.paired_test: mean, 90% and 95%
t-intervals, one-sided p of a fall) and, for the falls, Fisher's exact test (two-sided: the
tables at most as likely as the one seen, given both arms' runs that reached).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import compare_decisive as decisive  # noqa: E402

FELL_BELOW = 0.30
LEVEL = 0.90
COMPARISONS = {"decisive": (decisive.RECORDS, tuple(decisive.ARMS)),
               "confirmatory": ("docs/results/records/smollm2_confirmatory",
                                ("on_policy", "replay"))}


def run_figures(curve: dict, target: float = decisive.TARGET, below: float = FELL_BELOW) -> dict:
    """One run's peak, final, whether it reached the target and whether it then fell below."""
    acc = curve["accuracy"]
    first = next((i for i in range(1, len(acc)) if acc[i] >= target - 1e-9), None)
    lowest = None if first is None else min(acc[first:])
    return {"peak": max(acc[1:]), "final": acc[-1], "reached": first is not None,
            "fell": lowest is not None and lowest < below, "lowest_after_reach": lowest}


def clopper_pearson(k: int, n: int, level: float = LEVEL) -> list[float]:
    """The exact (Clopper-Pearson) interval of a proportion k / n: each tail (1 - level) / 2."""
    from power import betainc, quantile
    tail = (1 - level) / 2
    lo = 0.0 if k == 0 else quantile(lambda p: betainc(k, n - k + 1, p), tail, 0.0, 1.0)
    hi = 1.0 if k == n else quantile(lambda p: betainc(k + 1, n - k, p), 1 - tail, 0.0, 1.0)
    return [lo, hi]


def fisher_exact(a: int, n1: int, b: int, n2: int) -> float:
    """Two-sided Fisher's exact p of a of n1 against b of n2: the probability, given the margins, of
    the tables at most as likely as this one."""
    total, k = n1 + n2, a + b
    prob = [math.comb(n1, x) * math.comb(n2, k - x) / math.comb(total, k)
            for x in range(max(0, k - n2), min(k, n1) + 1)]
    seen = math.comb(n1, a) * math.comb(n2, b) / math.comb(total, k)
    return min(1.0, sum(p for p in prob if p <= seen * (1 + 1e-9)))


def mean_interval(values: list[float], level: float = LEVEL) -> dict:
    from power import t_quantile
    n, mean = len(values), statistics.fmean(values)
    half = t_quantile(1 - (1 - level) / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "interval_90": [mean - half, mean + half], "values": values}


def readout(all_curves: dict) -> dict:
    """Per arm and per pair (the seeds every arm has), as the module's docstring says."""
    seeds = sorted(set.intersection(*(set(c) for c in all_curves.values())))
    runs = {a: {s: run_figures(all_curves[a][s]) for s in seeds} for a in all_curves}
    out = {"seeds": seeds, "target": decisive.TARGET, "fell_below": FELL_BELOW, "level": LEVEL,
           "arms": {}, "pairs": {}}
    for arm, r in runs.items():
        reached = [s for s in seeds if r[s]["reached"]]
        fell = [s for s in reached if r[s]["fell"]]
        out["arms"][arm] = {
            "peak": mean_interval([r[s]["peak"] for s in seeds]),
            "final": mean_interval([r[s]["final"] for s in seeds]),
            "reached": len(reached), "runs": len(seeds),
            "reached_interval_90": clopper_pearson(len(reached), len(seeds)),
            "fell": len(fell), "fell_interval_90": clopper_pearson(len(fell), len(reached)),
            "fell_seeds": {str(s): {"peak": r[s]["peak"], "lowest_after_reach":
                                    r[s]["lowest_after_reach"], "final": r[s]["final"]}
                           for s in fell}}
    for a, b in decisive.PAIRS:
        if a in runs and b in runs:
            ea, eb = out["arms"][a], out["arms"][b]
            out["pairs"][f"{a}/{b}"] = {
                key: decisive.paired_test([runs[a][s][key] - runs[b][s][key] for s in seeds])
                for key in ("peak", "final")}
            out["pairs"][f"{a}/{b}"]["fell_fisher_p"] = fisher_exact(
                ea["fell"], ea["reached"], eb["fell"], eb["reached"])
    return out


def diff(x: float) -> str:
    return f"{x:+.3f}"


def interval(fig: dict, key: str = "interval_90", f=lambda x: f"{x:.3f}") -> str:
    lo, hi = fig[key]
    return f"{f(fig['mean'])} [{f(lo)}, {f(hi)}]"


def count(k: int, n: int, ci: list[float]) -> str:
    return f"{k} of {n} [{ci[0]:.2f}, {ci[1]:.2f}]"


def table(path: str) -> str:
    """The page's table: per arm, then per pair."""
    v = json.load(open(os.path.join(ROOT, path)))
    lines = ["| arm | peak accuracy, mean [90% t] | final accuracy (6,400 tokens), mean [90% t] "
             "| reached 0.45 [90% Clopper-Pearson] | of those, fell below 0.30 later [90% "
             "Clopper-Pearson] | the runs that fell: seed (peak, lowest after reaching, final) |",
             "|---|---|---|---|---|---|"]
    for arm, e in v["arms"].items():
        who = ", ".join(f"{s} ({x['peak']:.2f}, {x['lowest_after_reach']:.2f}, {x['final']:.2f})"
                        for s, x in e["fell_seeds"].items()) or "none"
        lines.append(f"| {arm} | {interval(e['peak'])} | {interval(e['final'])} | "
                     f"{count(e['reached'], e['runs'], e['reached_interval_90'])} | "
                     f"{count(e['fell'], e['reached'], e['fell_interval_90'])} | {who} |")
    lines += ["", "| pair (paired by seed) | peak, difference [90% t]; 95% t | final, difference "
              "[90% t]; 95% t | falls: Fisher's exact p (two-sided) |", "|---|---|---|---|"]
    for pair, e in v["pairs"].items():
        cells = [f"{interval(e[k], f=diff)}; [{diff(e[k]['interval_95'][0])}, "
                 f"{diff(e[k]['interval_95'][1])}]" for k in ("peak", "final")]
        lines.append(f"| {pair.replace('/', ' - ')} | {cells[0]} | {cells[1]} | "
                     f"{e['fell_fisher_p']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="holding.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comparison", choices=tuple(COMPARISONS), default="decisive")
    p.add_argument("--output", default=None, help="the JSON (default docs/results/smollm2_"
                   "<comparison>_holding.json); '-': print only")
    args = p.parse_args(argv)
    records, arms = COMPARISONS[args.comparison]
    curves = decisive.curves(records, {a: decisive.ARMS[a] for a in arms})
    if len(set.intersection(*(set(c) for c in curves.values()))) < 2:
        p.error(f"{args.comparison}: fewer than 2 seeds with every arm's records")
    r = {"comparison": args.comparison, "records": records, **readout(curves)}
    path = args.output or os.path.join("docs", "results", f"smollm2_{args.comparison}_holding.json")
    if args.output != "-":
        with open(os.path.join(ROOT, path), "w") as f:
            json.dump(r, f, indent=1)
            f.write("\n")
        print(table(path))
    else:
        print(json.dumps(r, indent=1))
    return r


if __name__ == "__main__":
    main()
