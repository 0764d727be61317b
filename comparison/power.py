"""How many seeds a comparison needs to see the paper's saving: the power statement of issue 52,
from the per-seed spread of a committed comparison (by default the SmolLM2 one).

    python comparison/power.py                                              # prints it
    python comparison/power.py --output docs/results/smollm2_power.json     # and writes it

The test. A pair of arms is read per replicate (replicate i of both starts from the same model
with the same seed): d_i = arm_i - reference_i, for tokens d_i = log(arm_i / reference_i). A
difference is detected when the 90% interval of the mean of the d_i lies wholly on one side of 0:
a one-sided paired t-test at 5%, mean(d) + t(0.95, n-1) sd(d) / sqrt(n) < 0 for a saving.

Power. With n seeds and d_i ~ Normal(-delta, sigma^2), sigma the committed seeds' standard
deviation, the test detects delta with the probability
    power(n, delta) = P(delta / sigma > m + t(0.95, n-1) s / sqrt(n)),
    m ~ Normal(0, 1/n),  (n - 1) s^2 ~ chi^2(n - 1)  (the mean and sd of n standard normals),
taken over --simulations draws of (m, s), the same draws for every delta: power rises with delta,
and the smallest delta detected with 80% power at n seeds is the 80% quantile of the thresholds.
The seeds needed: the smallest n with power(n, delta) >= 0.8. sigma from 5 seeds is itself
uncertain: its 90% interval (chi-square) is given, and the seeds needed at its upper end.

The figures (each pair, each replicate):
  tokens to first reach a target fixed before the runs (--target; each replicate's first eval at
      or above it, interpolated, stats.first_reach_point): the log ratio; a saving s is
      delta = -log(1 - s).
  the mean accuracy over the tokens (stats.area, the area under accuracy against tokens): the
      difference; a saving s, every accuracy of the reference reached at (1 - s) of its tokens
      and its last one kept after the budget, raises the reference's mean curve's area A by
      s (a_end - A), a_end its last point (exact for the curve drawn through its evals).
  tokens to first reach the comparison's own target (on-policy's final accuracy): as above, a
      replicate that never reaches it counted at its last eval (a lower bound of its tokens,
      which favours its arm).
  final accuracy (the median of the last three evals) and entropy (the last 5% of steps, the
      committed records' only entropy): the smallest difference detected.
The standard library only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import stats  # noqa: E402

SOURCE = "docs/results/smollm2_filtered.json"
PAIRS = (("replay", "on_policy"), ("replay", "control"))
SEEDS = (5, 10, 15, 20)
PRIMARY = ("first_reach_tokens_log_ratio", "area_diff")      # the planned comparison's primary


# ---- the distributions ------------------------------------------------------------------------
def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Lentz)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):                   # the fraction converges fast below this
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f / a


def gammainc(a: float, x: float) -> float:
    """The regularized lower incomplete gamma function P(a, x): its series below a + 1, else its
    continued fraction (Lentz)."""
    if x <= 0:
        return 0.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        for n in range(1, 1000):
            term *= x / (a + n)
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return total * math.exp(log_front)
    tiny, b = 1e-300, x + 1 - a
    c, d = 1 / tiny, 1 / b
    f = d
    for n in range(1, 1000):
        num = -n * (n - a)
        b += 2
        d = num * d + b
        d = 1 / (d if abs(d) > tiny else tiny)
        c = b + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return 1.0 - math.exp(log_front) * f


def quantile(cdf, p: float, lo: float, hi: float) -> float:
    """x with cdf(x) = p, by bisection on [lo, hi] (cdf increasing)."""
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    return quantile(lambda t: t_cdf(t, df), p, -1e3, 1e3)


def chi2_quantile(p: float, df: float) -> float:
    return quantile(lambda x: gammainc(df / 2, x / 2), p, 0.0, 1e4)


# ---- power ------------------------------------------------------------------------------------
def thresholds(n: int, simulations: int, seed: int = 0, alpha: float = 0.05) -> list[float]:
    """For n seeds, each simulated experiment's threshold m + t(1 - alpha, n - 1) s / sqrt(n), in
    units of sigma, sorted: the test detects delta in that experiment when delta / sigma is at or
    above it."""
    rng = random.Random(f"{seed}-{n}")
    c = t_quantile(1 - alpha, n - 1)
    out = []
    for _ in range(simulations):
        m = rng.gauss(0.0, 1.0 / math.sqrt(n))                          # the mean of n N(0, 1)
        sd = math.sqrt(rng.gammavariate((n - 1) / 2, 2.0) / (n - 1))    # their sd: chi2(n - 1)
        out.append(m + c * sd / math.sqrt(n))
    return sorted(out)


def exact_power(n: int, effect: float, alpha: float = 0.05) -> float:
    """The exact power of the one-sided paired t-test at alpha with n seeds, for a true effect of
    `effect` sigmas (the noncentral t's upper tail, without simulation). With m the mean and s the
    sd of n standard normals, the test detects the effect when m + c s / sqrt(n) <= effect,
    c = t(1 - alpha, n - 1); given s that is Phi(sqrt(n) effect - c s), and u = s sqrt(n - 1)
    follows the chi distribution with n - 1 degrees of freedom, so
        power = integral over u of Phi(sqrt(n) effect - c u / sqrt(n - 1)) chi_pdf(u; n - 1) du,
    taken by Simpson's rule on u in [0, sqrt(the chi2's 1 - 1e-12 quantile)] (2,000 panels)."""
    df, c = n - 1, t_quantile(1 - alpha, n - 1)
    top, panels = math.sqrt(chi2_quantile(1 - 1e-12, df)), 2000
    h = top / panels
    log_norm = math.log(2) - math.lgamma(df / 2) - (df / 2) * math.log(2)

    def f(u: float) -> float:
        z = math.sqrt(n) * effect - c * u / math.sqrt(df)
        density = (math.exp(log_norm) if df == 1 else 0.0) if u == 0 else \
            math.exp(log_norm + (df - 1) * math.log(u) - u * u / 2)
        return 0.5 * math.erfc(-z / math.sqrt(2)) * density
    total = f(0.0) + f(top) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, panels))
    return total * h / 3


def exact_seeds_needed(effect: float, power: float = 0.9, alpha: float = 0.05,
                       most: int = 500) -> int | None:
    """The fewest seeds (2 or more) whose one-sided paired t-test at alpha detects an effect of this
    many sigmas with at least the power asked (exact_power); None: more than `most`."""
    return next((n for n in range(2, most + 1) if exact_power(n, effect, alpha) >= power), None)


class Power:
    """power(n, effect) and the smallest effect detected at n, in units of sigma, for one set of
    simulated experiments per n (built once, shared by every figure)."""

    def __init__(self, simulations: int = 20_000, seed: int = 0, alpha: float = 0.05,
                 power: float = 0.8):
        self.simulations, self.seed, self.alpha, self.power = simulations, seed, alpha, power
        self.cache: dict[int, list[float]] = {}

    def of(self, n: int) -> list[float]:
        if n not in self.cache:
            self.cache[n] = thresholds(n, self.simulations, self.seed, self.alpha)
        return self.cache[n]

    def at(self, n: int, effect: float) -> float:
        """The probability that n seeds detect an effect of this many sigmas."""
        t = self.of(n)
        lo, hi = 0, len(t)                  # how many thresholds lie at or below the effect
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if t[mid] <= effect else (lo, mid)
        return lo / len(t)

    def smallest(self, n: int) -> float:
        """The smallest effect (in sigmas) that n seeds detect with the power asked."""
        t = self.of(n)
        return t[math.ceil(self.power * len(t)) - 1]

    def seeds_needed(self, effect: float, most: int = 200) -> int | None:
        """The fewest seeds (2 or more) that detect the effect with the power asked; None: more
        than `most`."""
        return next((n for n in range(2, most + 1) if self.at(n, effect) >= self.power), None)


def spread(values: list[float]) -> dict:
    """The per-seed values' mean, standard deviation and its 90% interval (chi-square, n - 1)."""
    n, sd = len(values), statistics.stdev(values)
    return {"per_seed": values, "mean": statistics.fmean(values), "sd": sd,
            "sd_ci": [sd * math.sqrt((n - 1) / chi2_quantile(0.95, n - 1)),
                      sd * math.sqrt((n - 1) / chi2_quantile(0.05, n - 1))]}


def figure(values: list[float], power: Power, effect: float | None, seeds=SEEDS) -> dict:
    """One figure's power statement: its spread, and with an effect (the paper's saving, in the
    figure's units) the seeds needed (at the sd, and at its interval's upper end) and the power at
    each n of seeds; always the smallest difference n seeds detect."""
    out = spread(values)
    sd, sd_hi = out["sd"], out["sd_ci"][1]
    out["smallest_diff_at"] = {str(n): power.smallest(n) * sd for n in seeds}
    if effect is not None:
        out["effect"] = effect
        out["seeds_needed"] = power.seeds_needed(effect / sd)
        out["seeds_needed_at_sd_hi"] = power.seeds_needed(effect / sd_hi)
        out["power_at"] = {str(n): power.at(n, effect / sd) for n in seeds}
        out["power_at_sd_hi"] = {str(n): power.at(n, effect / sd_hi) for n in seeds}
    return out


def first_tokens(run: dict, target: float) -> float:
    """Tokens to a run's first reach of the target; never reached: its last eval's tokens."""
    point = stats.first_reach_point(run, target)
    return point["tokens"] if point else run["tokens"][-1]


def statement(summary: dict, target: float, saving: float = 0.4, pairs=PAIRS,
              power: Power | None = None, seeds=SEEDS) -> dict:
    """The power statement of one comparison's summary, for each pair of arms (see the docstring),
    at each n of seeds and at the seeds it plans (seeds_planned)."""
    power = power or Power()
    first = pair_figures(summary, target, saving, pairs, power, seeds)
    # the seeds to run: 80% power at the sd's upper 90% end for both primary figures of every pair
    # (tokens to first reach the fixed target, and the area), and never fewer than 10
    need = [f[k]["seeds_needed_at_sd_hi"] for f in first.values() for k in PRIMARY]
    planned = None if None in need else max(10, *need)
    every = tuple(sorted({*seeds, planned} - {None}))
    return {"target": target, "own_target": summary["target_accuracy"], "saving": saving,
            "seeds": len(summary["arms"]["on_policy"]["replicates"]), "power": power.power,
            "alpha_one_sided": power.alpha, "simulations": power.simulations,
            "simulation_seed": power.seed, "seeds_planned": planned,
            "seeds_planned_rule": f"the most seeds any primary figure ({', '.join(PRIMARY)}) of "
                                  "any pair needs for 80% power at its sd's upper 90% end; at "
                                  "least 10",
            "pairs": pair_figures(summary, target, saving, pairs, power, every)}


def pair_figures(summary: dict, target: float, saving: float, pairs, power: Power,
                 seeds) -> dict:
    """Each pair's figures (see the docstring), their power at each n of seeds."""
    runs = {a: [{k: v for k, v in r.items() if k != "reach"} for r in e["replicates"]]
            for a, e in summary["arms"].items()}
    own = summary["target_accuracy"]
    delta = -math.log(1 - saving)
    out = {}
    for arm, ref in pairs:
        a, b = runs[arm], runs[ref]            # replicate i of the arm with replicate i of ref

        def log_ratio(t: float) -> list[float]:
            return [math.log(first_tokens(x, t) / first_tokens(y, t)) for x, y in zip(a, b)]

        def diff(value) -> list[float]:
            return [value(x) - value(y) for x, y in zip(a, b)]
        curve = stats.mean_curve(b)
        per_unit = curve["accuracy"][-1] - stats.area(curve)        # the area a whole saving adds
        figs = {
            "first_reach_tokens_log_ratio": figure(log_ratio(target), power, delta, seeds),
            "area_diff": {**figure(diff(stats.area), power, saving * per_unit, seeds),
                          "saving_per_unit": per_unit},
            "own_target_first_reach_tokens_log_ratio": {
                **figure(log_ratio(own), power, delta, seeds),
                "replicates_not_reaching": sum(stats.first_reach_point(r, own) is None
                                               for r in a + b)},
            "final_accuracy_diff": figure(diff(lambda r: stats.final_accuracy(r["accuracy"])),
                                          power, None, seeds),
            "entropy_tail_diff": figure(diff(lambda r: r["entropy"]), power, None, seeds)}
        for key in ("first_reach_tokens_log_ratio", "own_target_first_reach_tokens_log_ratio"):
            f = figs[key]           # a log ratio detected at n seeds, as a saving of tokens
            f["smallest_saving_at"] = {n: 1 - math.exp(-d)
                                       for n, d in f["smallest_diff_at"].items()}
        f = figs["area_diff"]
        f["smallest_saving_at"] = {n: d / per_unit for n, d in f["smallest_diff_at"].items()}
        out[f"{arm} / {ref}"] = figs
    return out


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def table(s: dict) -> str:
    """The statement as docs/results.md shows it: per pair and figure, the committed seeds' sd with
    its 90% interval, the seeds needed to detect the saving with 80% power (at the sd; at its upper
    end), the power of the committed seeds and of the planned ones (at the sd; at its upper end),
    and the smallest saving the planned seeds detect with 80% power (at the sd)."""
    n, k = str(s["seeds_planned"]), str(s["seeds"])
    lines = [f"| pair | figure | sd over {k} seeds [90%] | seeds for {pct(s['power'])} power at a "
             f"{pct(s['saving'])} saving (at the sd's upper end) | power of {k} seeds "
             f"| power of {n} seeds (at the sd's upper end) | smallest saving {n} seeds detect |",
             "|---|---|---|---|---|---|---|"]
    names = {"first_reach_tokens_log_ratio": f"tokens to first reach {s['target']:g}, log ratio",
             "area_diff": "mean accuracy over the tokens (area), difference",
             "own_target_first_reach_tokens_log_ratio":
                 f"tokens to first reach {s['own_target']:.2f} (on-policy's final), log ratio"}
    need = lambda x: "more than 200" if x is None else str(x)      # noqa: E731
    for pair, figs in s["pairs"].items():
        for key, name in names.items():
            f = figs[key]
            lo, hi = f["sd_ci"]
            lines.append(f"| {pair} | {name} | {f['sd']:.3f} [{lo:.3f}, {hi:.3f}] "
                         f"| {need(f['seeds_needed'])} ({need(f['seeds_needed_at_sd_hi'])}) "
                         f"| {f['power_at'][k]:.2f} | {f['power_at'][n]:.2f} "
                         f"({f['power_at_sd_hi'][n]:.2f}) | {pct(f['smallest_saving_at'][n])} |")
    return "\n".join(lines)


def differences_table(s: dict) -> str:
    """The smallest differences n seeds detect with 80% power (at the sd), for the figures without
    a saving: at the committed seeds' number, 10, and the planned seeds."""
    seeds = [str(s["seeds"]), "10", str(s["seeds_planned"])]
    lines = [f"| pair | figure | sd over {s['seeds']} seeds [90%] | smallest difference detected "
             f"by {' / '.join(seeds)} seeds |", "|---|---|---|---|"]
    names = {"final_accuracy_diff": "final accuracy",
             "entropy_tail_diff": "entropy, last 5% of steps (nats)"}
    for pair, figs in s["pairs"].items():
        for key, name in names.items():
            f = figs[key]
            lo, hi = f["sd_ci"]
            d = " / ".join(f"{f['smallest_diff_at'][k]:.3f}" for k in seeds)
            lines.append(f"| {pair} | {name} | {f['sd']:.3f} [{lo:.3f}, {hi:.3f}] | {d} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="power.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summary", default=SOURCE,
                   help="a summary.json of compare.py, with its replicates")
    p.add_argument("--target", type=float, default=0.45, help="the fixed target, on the rise")
    p.add_argument("--saving", type=float, default=0.4,
                   help="the saving of tokens to detect (the paper's 40%%)")
    p.add_argument("--simulations", type=int, default=20_000, help="simulated experiments per n")
    p.add_argument("--output", default="", help="write the statement as JSON here")
    args = p.parse_args(argv)
    s = statement(json.load(open(os.path.join(ROOT, args.summary))), args.target, args.saving,
                  power=Power(args.simulations))
    s = {"source": args.summary, "about": "the power statement of issue 52 (comparison/power.py): "
         "how many seeds a paired comparison of this spread needs; the test, the power and the "
         "figures as its docstring says", **s}
    print(table(s))
    print()
    print(differences_table(s))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(s, f, indent=1)
            f.write("\n")
    return s


if __name__ == "__main__":
    main()
