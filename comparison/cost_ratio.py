"""Issue 67, part 2: does replay pay at *your* hardware's cost ratio? Replay's compute to first
reach 0.45 against on-policy's, per seed, as a function of the cost ratio c: the seconds to
generate one rollout over the seconds to train on one (train.py's end summary prints a run's own;
the paper and issue 67 call it mu, a letter this project keeps for the behaviour policy).

    python comparison/cost_ratio.py                          # the decisive comparison's 10 seeds
    python comparison/cost_ratio.py --comparison confirmatory    # once its records are in
    python comparison/cost_ratio.py --comparison both        # replay and on_policy of both, by seed

Each writes docs/results/smollm2_<comparison>_cost_ratio.json and its plot (.png); runs nothing.

Compute to a run's first reach of 0.45 (compare_decisive.first_reach: interpolated between evals; a
run that never reaches counts at the budget, 6,400 tokens, and its rounds and steps there), in
units of training one rollout (or one token), on two bases:
  rollouts: c x rollouts generated (rounds x R) + rollouts trained (steps x B)
  tokens:   c x tokens generated + tokens trained, the tokens trained estimated as tokens generated
            x (rollouts trained / rollouts generated): the records keep no count of trained tokens,
            so a trained rollout is taken to have the run's mean generated length
Per seed d(c) = log(replay's compute / on_policy's); its mean and paired t-intervals (90%: each end
a one-sided 0.05 bound; 95%: 0.025, the decisive look's alpha), as ratios exp(d), at each c of a
log grid from 0.5 to 30. The break-even: every c in [0.01, 10^4] where the mean of d crosses 0;
beside it where each end of each interval does, and the ranges of c where the 90% interval lies
wholly above 1 (replay costs more), holds 1 (no difference detected) or lies below it (a saving).
As c grows the ratio tends to the ratio of rollouts (tokens) generated; at c = 0, of training.

The cost ratios marked:
  this CPU's: the on-policy runs' own seconds (compare_decisive.measured_mu; on tokens, generation
    seconds per generated token over training seconds per trained token, estimated as above);
  a GPU's, from docs/gpu.md's Speed table (a 0.5B-shaped model, bf16, benchmarks/bench.py: a round
    generates 64 rollouts, 8 prompts x 8, and trains one step on B = 64 of them, so per rollout c =
    generation ms / training ms): with the fast path 1,461 ms / 229 ms = 6.38 (its tokens per
    second, 35,762 trained / 5,605 sampled, give the same 6.38 per token); with plain `generate`
    only the share f of a round was kept (90-96%), and c = f / (1 - f) = 9.0-24 counts the rest of
    the round as training: the buffer's share of it makes the true c larger, so these are lower
    bounds.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import compare_decisive as decisive  # noqa: E402

PAIR = ("replay", "on_policy")
BASES = ("rollouts", "tokens")
LOW, HIGH, POINTS = 0.5, 30.0, 81           # the grid of the JSON and the plot: log-spaced
SEARCH = (0.01, 1e4, 4001)                  # where crossings are looked for, and how finely
MAX_FLIPPED = 20    # seeds up to which the exact sign-flip p is given (2^n sums; both: 28 seeds)
# docs/gpu.md, Speed (tested against the page): a round of bench.py with the fast path, and the
# generation shares of a round measured without it; 64 rollouts generated and 64 trained a round
GPU_ROUND_MS = {"generation": 1461.0, "training": 229.0}
GPU_PLAIN_SHARES = (0.90, 0.96)
COMPARISONS = {"decisive": (decisive.RECORDS,),
               "confirmatory": ("docs/results/records/smollm2_confirmatory",),
               "both": (decisive.RECORDS, "docs/results/records/smollm2_confirmatory")}


def load(comparison: str) -> dict:
    """{arm: {seed: curve}} of replay and on_policy in the comparison's records (both: the two
    comparisons' seeds together; they share none)."""
    arms = {a: decisive.ARMS[a] for a in PAIR}
    out = {a: {} for a in PAIR}
    for records in COMPARISONS[comparison]:
        for arm, runs in decisive.curves(records, arms).items():
            if set(runs) & set(out[arm]):
                raise ValueError(f"{records}: seeds {sorted(set(runs) & set(out[arm]))} twice")
            out[arm].update(runs)
    return out


def parts(curve: dict) -> tuple[float, float, float]:
    """A run's (rollouts generated, rollouts trained, tokens generated) to its first reach."""
    reach = decisive.first_reach(curve)
    return reach["rounds"] * curve["R"], reach["steps"] * curve["B"], reach["tokens"]


def cost(p: tuple[float, float, float], c: float, basis: str) -> float:
    """Compute to the first reach in units of training one rollout (one token); c = inf: per unit
    of c, the generation alone."""
    generated, trained, tokens = p
    if basis == "rollouts":
        return generated if math.isinf(c) else c * generated + trained
    return tokens if math.isinf(c) else tokens * (c + trained / generated)


def paired_parts(all_curves: dict, pair=PAIR) -> list[tuple]:
    """Per seed both arms have, in seed order: (the arm's parts, the reference's)."""
    a, b = pair
    return [(parts(all_curves[a][s]), parts(all_curves[b][s]))
            for s in sorted(set(all_curves[a]) & set(all_curves[b]))]


@functools.lru_cache(maxsize=None)
def t_point(p: float, df: int) -> float:
    from power import t_quantile
    return t_quantile(p, df)


def log_ratios(pp: list[tuple], c: float, basis: str) -> list[float]:
    return [math.log(cost(x, c, basis) / cost(y, c, basis)) for x, y in pp]


def ends(d: list[float]) -> dict:
    """The mean of d and the ends of its 90% and 95% t-intervals (logs)."""
    n, mean = len(d), statistics.fmean(d)
    se = statistics.stdev(d) / math.sqrt(n)
    h90, h95 = t_point(0.95, n - 1) * se, t_point(0.975, n - 1) * se
    return {"mean": mean, "low_90": mean - h90, "high_90": mean + h90, "low_95": mean - h95,
            "high_95": mean + h95}


def at(pp: list[tuple], c: float, basis: str) -> dict:
    """The ratio of compute (exp of the mean log ratio) at c and its 90% and 95% intervals."""
    e = {k: math.exp(v) for k, v in ends(log_ratios(pp, c, basis)).items()}
    return {"c": c, "ratio": e["mean"], "ratio_90": [e["low_90"], e["high_90"]],
            "ratio_95": [e["low_95"], e["high_95"]]}


def crossings(pp: list[tuple], basis: str, key: str, search=SEARCH) -> list[float]:
    """Every c in the search range where ends(...)[key] crosses 0 (found on a log grid, refined by
    bisection)."""
    lo, hi, n = search
    grid = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    value = lambda c: ends(log_ratios(pp, c, basis))[key]          # noqa: E731
    out, before = [], value(grid[0])
    for a, b in zip(grid, grid[1:]):
        now = value(b)
        if (before < 0) != (now < 0):
            x, y, fx = a, b, before
            for _ in range(60):
                mid = math.sqrt(x * y)
                fm = value(mid)
                x, y, fx = (mid, y, fm) if (fm < 0) == (fx < 0) else (x, mid, fx)
            out.append(math.sqrt(x * y))
        before = now
    return out


def ranges(pp: list[tuple], basis: str, search=SEARCH) -> list[dict]:
    """The search range cut where an end of the 90% interval crosses 1, each piece named by where
    the interval lies: "replay costs more" (wholly above 1), "no difference detected" (holds 1),
    "replay saves" (wholly below 1)."""
    cuts = sorted(crossings(pp, basis, "low_90", search) + crossings(pp, basis, "high_90", search))
    edges = [search[0]]
    for x in cuts + [search[1]]:          # both ends at one c (no spread): one cut
        if x > edges[-1] * (1 + 1e-9):
            edges.append(x)
    out = []
    for a, b in zip(edges, edges[1:]):
        e = ends(log_ratios(pp, math.sqrt(a * b), basis))
        words = ("replay costs more" if e["low_90"] > 0 else "replay saves" if e["high_90"] < 0
                 else "no difference detected")
        out.append({"from": a, "to": b, "at_90": words})
    return out


def cpu_ratio(all_curves: dict, basis: str) -> float:
    """Generation / training seconds per rollout (per token: per generated token / per trained
    token, trained tokens estimated as the module says) over the on-policy runs' records."""
    gen = train = generated = trained = 0.0
    for curve in all_curves["on_policy"].values():
        r = curve["record"]
        last = r["evals"][-1]
        if last["round"] != r["last"]["round"]:
            raise ValueError(f"seed {r['config']['seed']}: its last eval is not its last round")
        share = r["rounds"]["steps"] * curve["B"] / r["rounds"]["generated"]
        gen, train = gen + r["last"]["gen_seconds"], train + r["last"]["train_seconds"]
        if basis == "rollouts":
            generated += r["rounds"]["generated"]
            trained += r["rounds"]["steps"] * curve["B"]
        else:
            generated += last["gen_tokens"]
            trained += last["gen_tokens"] * share
    return (gen / generated) / (train / trained)


def gpu_ratios() -> dict:
    """docs/gpu.md's GPU, as the module's docstring derives it."""
    lo, hi = (f / (1 - f) for f in GPU_PLAIN_SHARES)
    return {"gpu_fast": GPU_ROUND_MS["generation"] / GPU_ROUND_MS["training"],
            "gpu_plain_low": lo, "gpu_plain_high": hi}


def readout(all_curves: dict, grid: int = POINTS) -> dict:
    """The figures of the module's docstring, per basis."""
    pp = paired_parts(all_curves)
    seeds = sorted(set(all_curves[PAIR[0]]) & set(all_curves[PAIR[1]]))
    cs = [LOW * (HIGH / LOW) ** (i / (grid - 1)) for i in range(grid)]
    out = {"pair": "/".join(PAIR), "seeds": seeds, "target": decisive.TARGET,
           "budget_tokens": decisive.BUDGET, "grid": [LOW, HIGH], "search": list(SEARCH[:2]),
           "reached": {a: sum(decisive.first_reach(all_curves[a][s])["reached"] for s in seeds)
                       for a in PAIR},
           "gpu": gpu_ratios(), "bases": {}}
    for basis in BASES:
        marks = {"cpu": cpu_ratio(all_curves, basis), **out["gpu"]}
        out["bases"][basis] = {
            "curve": [at(pp, c, basis) for c in cs],
            "break_even": crossings(pp, basis, "mean"),
            "crossings": {k: crossings(pp, basis, k)
                          for k in ("low_90", "high_90", "low_95", "high_95")},
            "ranges_90": ranges(pp, basis),
            "marked": {name: {**at(pp, c, basis), "log_compute_ratio": decisive.paired_test(
                log_ratios(pp, c, basis), permutation=len(pp) <= MAX_FLIPPED)}
                for name, c in marks.items()},
            "at_zero": at(pp, 0.0, basis), "at_infinity": {**at(pp, math.inf, basis),
                                                           "c": "infinity"}}
    return out


def plot(r: dict, path: str, title: str):
    """Two panels (rollouts, tokens): the ratio of compute against c with its 90% band, 1 dashed,
    the break-even and the marked cost ratios."""
    from infra import curves
    fig = curves.new_figure(path, (12, 5.5))
    if fig is None:
        return None
    axes = fig.subplots(1, 2, sharey=True)
    for ax, basis in zip(axes, BASES):
        b = r["bases"][basis]
        cs = [p["c"] for p in b["curve"]]
        ax.fill_between(cs, [p["ratio_90"][0] for p in b["curve"]],
                        [p["ratio_90"][1] for p in b["curve"]], alpha=0.2, color="C0",
                        label="its 90% paired t-interval")
        ax.plot(cs, [p["ratio"] for p in b["curve"]], color="C0",
                label="replay / on-policy (exp of the mean log ratio)")
        ax.axhline(1.0, **curves.REFERENCE)
        m = b["marked"]
        ax.axvline(m["cpu"]["c"], color="C2", lw=1.2, label="this CPU (the on-policy runs)")
        ax.axvline(m["gpu_fast"]["c"], color="C3", lw=1.2,
                   label=f"GPU, fast path ({m['gpu_fast']['c']:.1f}, docs/gpu.md)")
        ax.axvspan(m["gpu_plain_low"]["c"], m["gpu_plain_high"]["c"], color="C3", alpha=0.08,
                   label="GPU, plain generate (at least 9-24)")
        for x in b["break_even"]:
            if LOW <= x <= HIGH:
                ax.plot([x], [1.0], "ko", label="break-even of the mean")
                ax.annotate(f"{x:.1f}", (x, 1.0), textcoords="offset points", xytext=(4, 6))
        ax.annotate(f"{m['cpu']['c']:.2f}", (m["cpu"]["c"], 0.05), color="C2",
                    xycoords=("data", "axes fraction"), textcoords="offset points", xytext=(3, 0))
        ax.set_xscale("log")
        ticks = [0.5, 1, 2, 5, 10, 20, 30]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_xlim(LOW, HIGH)
        ax.set_xlabel("cost ratio c: generation / training seconds per "
                      + ("rollout" if basis == "rollouts" else "token"))
        ax.set_title(f"on a {basis} basis", fontsize=11)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=9)
    fig.axes[0].set_ylabel("compute to first reach 0.45, replay / on-policy")
    fig.suptitle(title, fontsize=11)
    curves.save(fig, path, dpi=110)
    return fig


def ratio(m: dict) -> str:
    lo, hi = m["ratio_90"]
    return f"{m['ratio']:.2f}x [{lo:.2f}, {hi:.2f}]"


def where(b: dict, words: str) -> str:
    """The cost ratios (in the search range) where the 90% interval lies as the words say."""
    got = [x for x in b["ranges_90"] if x["at_90"] == words]
    if not got:
        return f"at no c up to {b['ranges_90'][-1]['to']:,.0f}"
    return "; ".join("c below " + f"{x['to']:.2g}" if x["from"] == b["ranges_90"][0]["from"]
                     else "c above " + f"{x['from']:.2g}" if x["to"] == b["ranges_90"][-1]["to"]
                     else f"c {x['from']:.2g}-{x['to']:.2g}" for x in got)


def table(path: str) -> str:
    """The page's table of a cost-ratio JSON: per basis, the break-even, where the 90% interval lies
    above or below 1, and the compute ratio at each marked cost ratio and as c grows."""
    r = json.load(open(os.path.join(ROOT, path)))
    g = r["gpu"]
    lines = ["| basis | break-even (the mean) | replay costs more (90% interval above 1) | replay "
             "saves (90% interval below 1) | this CPU | GPU, fast path "
             f"({g['gpu_fast']:.1f}) | GPU, plain generate (at least {g['gpu_plain_low']:.0f}) | "
             f"(at least {g['gpu_plain_high']:.0f}) | as c grows without bound |",
             "|---|---|---|---|---|---|---|---|---|"]
    for basis, b in r["bases"].items():
        m = b["marked"]
        even = ", ".join(f"{x:.1f}" for x in b["break_even"]) or "none"
        lines.append(f"| {basis} | {even} | {where(b, 'replay costs more')} | "
                     f"{where(b, 'replay saves')} | c {m['cpu']['c']:.2f}: {ratio(m['cpu'])} | "
                     f"{ratio(m['gpu_fast'])} | {ratio(m['gpu_plain_low'])} | "
                     f"{ratio(m['gpu_plain_high'])} | {ratio(b['at_infinity'])} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="cost_ratio.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comparison", choices=tuple(COMPARISONS), default="decisive")
    p.add_argument("--output", default=None, help="the JSON (default docs/results/smollm2_"
                   "<comparison>_cost_ratio.json; the plot beside it, .png); '-': print only")
    args = p.parse_args(argv)
    curves = load(args.comparison)
    if len(set(curves[PAIR[0]]) & set(curves[PAIR[1]])) < 2:
        p.error(f"{args.comparison}: fewer than 2 seeds with both arms' records")
    r = {"comparison": args.comparison, "records": list(COMPARISONS[args.comparison]),
         **readout(curves)}
    for basis, b in r["bases"].items():
        even = ", ".join(f"{x:.2f}" for x in b["break_even"]) or "none"
        print(f"{basis}: break-even c {even}; " + "; ".join(
            f"{x['at_90']} at c {x['from']:.3g}-{x['to']:.3g}" for x in b["ranges_90"]))
        for name, m in b["marked"].items():
            print(f"  {name} c {m['c']:.2f}: {m['ratio']:.2f}x [{m['ratio_90'][0]:.2f}, "
                  f"{m['ratio_90'][1]:.2f}]")
    if args.output != "-":
        path = args.output or os.path.join(ROOT, "docs", "results",
                                           f"smollm2_{args.comparison}_cost_ratio.json")
        with open(path, "w") as f:
            json.dump(r, f, indent=1)
            f.write("\n")
        print(table(path))
        sys.path.insert(0, ROOT)
        plot(r, os.path.splitext(path)[0] + ".png",
             f"SmolLM2-135M, sums: replay (y = 2) against on-policy, {len(r['seeds'])} seeds "
             f"({args.comparison})")
    return r


if __name__ == "__main__":
    main()
