"""The paper's four claims beside what this project measured: the table that opens docs/results.md.

    python comparison/claims.py            # reads the committed summaries; runs nothing

First the pre-registered SmolLM2 comparison (issue 59, docs/plans/smollm2_decisive.md) from its
verdict JSON: the claims it decides, then each of its pairs. Then the earlier comparisons' table.
After it: each arm of the earlier SmolLM2 comparison, the arms of its y = 4 comparison and their
pairs across the two, and the lr check, each as docs/results.md holds it.

The paper ("Efficient RL Training for LLMs with Experience Replay", arXiv 2604.08706) claims that
replay (1) per optimizer step can slightly hurt, (2) per generated token learns faster (up to ~40%
less compute), (3) preserves the policy's entropy, (4) with a larger buffer learns more slowly but
more stably. Each row reads one pair of arms of a comparison (paired: replicate i of both arms in
each draw), recomputed from the per-replicate runs a summary keeps, with its own target rule and
its own draws (stats.figures and stats.bootstrap), so a figure that the summary stores too is the
same. The verdict says no more than the real model's interval: a claim agrees only when the whole
interval lies on the paper's side, and an interval across the line is "no detected difference".
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

import stats  # noqa: E402

# the comparisons each column reads (docs/results.md says how each was run)
REAL = "docs/results/smollm2_filtered.json"           # SmolLM2-135M, sums, 5 RL seeds, one lr
TINY = "docs/results/default_lr1e-3_early.json"       # the demo model, addition, 5 warm starts, one lr
TINY_TUNED = "docs/results/tuned_early.json"          # the same, each arm at its own best lr
STALENESS = "docs/staleness.json"                     # the demo model, written work, 3 warm starts

# (claim, what is measured, arm, reference, figure, kind, the paper's side of the line)
ROWS = [
    ("1. per optimizer step, replay can slightly hurt", "optimizer steps to hold the target, replay / "
     "on-policy", "replay", "on_policy", "step_ratio", "ratio", "above"),
    ("2. per generated token it learns faster (up to ~40% less compute)", "generated tokens to hold "
     "the target, replay / on-policy", "replay", "on_policy", "token_ratio", "ratio", "below"),
    ("", "generated tokens to first reach it, replay / on-policy", "replay", "on_policy",
     "first_token_ratio", "ratio", "below"),
    ("", "final accuracy at the same generated tokens (the budget), replay - on-policy", "replay",
     "on_policy", "accuracy_diff", "diff", "above"),
    ("", "generated tokens to hold it, replay / its control (as many steps per token, no reuse)",
     "replay", "control", "token_ratio", "ratio", "below"),
    ("3. it preserves the policy's entropy", "entropy at the end (nats a token), replay - on-policy",
     "replay", "on_policy", "entropy_diff", "diff", "not below"),
    ("4. a larger buffer learns more slowly", "generated tokens to first reach the target, N = 2B / "
     "N = B (the same uses)", "replay_big", "replay", "first_token_ratio", "ratio", "above"),
    ("", "generated tokens to hold it, N = 2B / N = B", "replay_big", "replay", "token_ratio",
     "ratio", "above"),
    ("", "final accuracy at the budget, N = 2B - N = B", "replay_big", "replay", "accuracy_diff",
     "diff", "below"),
    ("... but more stably", "fall after first reaching the target, N = 2B - N = B", "replay_big",
     "replay", "instability_diff", "diff", "below"),
]


def read(path: str) -> dict:
    return json.load(open(os.path.join(ROOT, path)))


def pair_figures(summary: dict, pairs: list[tuple[str, str]]) -> dict:
    """Point and 90% interval of each pair's figures, from the summary's own replicates and draws."""
    results = {arm: [{k: v for k, v in r.items() if k != "reach"} for r in e["replicates"]]
               for arm, e in summary["arms"].items()}
    pairs = [p for p in pairs if p[0] in results and p[1] in results]
    frac, n = summary.get("target_frac", 1.0), summary["args"]["bootstrap"]
    point = stats.figures(results, frac, pairs=pairs)["arms"]
    ci = stats.bootstrap(results, n, frac=frac, pairs=pairs)["arms"]
    return {p: (point[p[0]]["vs"][p[1]], ci[p[0]]["vs"][p[1]]) for p in pairs}


def number(x: float, kind: str) -> str:
    if math.isinf(x):
        return "not reached"                  # the arm never held (or first reached) the target
    if kind == "ratio":
        return f"{x:.2f}x"
    return f"{x:+.4f}" if 5e-5 <= abs(x) < 5e-4 else f"{x:+.3f}"     # +0.0003 is not +0.000


def cell(figs: dict, row: tuple) -> str:
    _, _, arm, ref, key, kind, _ = row
    if (arm, ref) not in figs:
        return "not run"
    point, (lo, hi) = figs[arm, ref][0][key], figs[arm, ref][1][key]
    return f"{number(point, kind)} [{number(lo, kind).rstrip('x')}, {number(hi, kind).rstrip('x')}]"


def verdict(figs: dict, row: tuple) -> str:
    """The real model's interval in words, against the paper's side of the line (1 or 0)."""
    _, _, arm, ref, key, kind, side = row
    lo, hi = figs[arm, ref][1][key]
    line = 1.0 if kind == "ratio" else 0.0
    if words := interval_side(lo, hi, line, side, f"{line:g}"):
        return words
    if side == "not below":
        return f"no detected difference (a fall of up to {-lo:.3f} not excluded)"
    return "no detected difference"


def interval_side(lo: float, hi: float, line: float, side: str, shown: str) -> str | None:
    """An interval wholly on one side of the line, in words against the paper's side ("above",
    "below" or "not below"); None when it holds the line. shown: the line as the page writes it."""
    if not (lo > line or hi < line):
        return None
    where = "above" if lo > line else "below"
    agrees = where == side or (side == "not below" and where == "above")
    return ("as the paper" if agrees else "against the paper") + f": the whole interval {where} {shown}"


def written(fig: dict, kind: str, level: int = 90) -> str:
    """A paired test's mean [90% interval] as the page writes it: a log ratio as the ratio ("0.78x
    [0.62, 0.99]"), a difference as itself ("+0.026 [+0.0004, +0.052]"); level 95: its 95% one."""
    f = (lambda x: number(math.exp(x), "ratio")) if kind == "ratio" else (lambda x: number(x, "diff"))
    lo, hi = fig[f"interval_{level}"]
    return f"{f(fig['mean'])} [{f(lo).rstrip('x')}, {f(hi).rstrip('x')}]"


def at_alphas(fig: dict, kind: str, side: str, alpha: float) -> str | None:
    """A secondary figure's interval in words at both levels that carry it: the 90% interval (each
    end a one-sided 0.05 bound) and the look's (one-sided alpha: the 95% interval at 0.025); None
    when the 90% interval holds the line (not detected at either)."""
    assert alpha == 0.025, "the 95% interval is the look's at one-sided 0.025 only"
    shown = "1" if kind == "ratio" else "0"
    lo, hi = fig["interval_90"]
    if not (lo > 0 or hi < 0):
        return None
    where = "above" if lo > 0 else "below"
    agrees = where == side or (side == "not below" and where == "above")
    words = "as the paper" if agrees else "against the paper"
    lo95, hi95 = fig["interval_95"]
    if lo95 > 0 or hi95 < 0:
        return (f"{words} at one-sided 0.05 and at this look's {alpha:g}: the whole 90% and 95% "
                f"intervals {where} {shown}")
    return (f"{words} at one-sided 0.05 only (the whole 90% interval {where} {shown}); not at this "
            f"look's {alpha:g}: 95% {written(fig, kind, 95).split(' ', 1)[1]}")


def staleness_cell() -> str:
    """Claim 4 on the demo model: the staleness runs (y = 4 at N = B and N = 2B, 3 warm starts each,
    no interval): the mean of the runs' last evals."""
    s = read(STALENESS)["settings"]
    last = {k: [r["evals"][-1] for r in s[k]["per_warm_start"].values()] for k in ("y4", "y4, N = 2B")}
    big, small = statistics.fmean(last["y4, N = 2B"]), statistics.fmean(last["y4"])
    return (f"another task (written work), y = 4, 3 runs, no interval: last eval {big:.3f} (N = 2B) vs "
            f"{small:.3f} (N = B)")


def table() -> str:
    pairs = sorted({(r[2], r[3]) for r in ROWS})
    real, tiny, tuned = (pair_figures(read(p), pairs) for p in (REAL, TINY, TINY_TUNED))
    lines = ["| the paper's claim | measured as | SmolLM2-135M, sums (5 RL seeds, one lr) | demo model, "
             "addition, one lr (5 warm starts) | demo model, each arm at its best lr | verdict on SmolLM2 |",
             "|---|---|---|---|---|---|"]
    for row in ROWS:
        if row[2] == "replay_big":
            tiny_cells = [staleness_cell() if row[4] == "accuracy_diff" else "not measured", "not run"]
        else:
            tiny_cells = [cell(tiny, row), cell(tuned, row)]
        lines.append(f"| {row[0]} | {row[1]} | {cell(real, row)} | {' | '.join(tiny_cells)} | "
                     f"{verdict(real, row)} |")
    return "\n".join(lines)


# the pre-registered comparison (docs/plans/smollm2_decisive.md): its verdict, compare_decisive.py's
DECISIVE = "docs/results/smollm2_decisive.json"
# (claim, what is measured, pair, figure, kind, the paper's side of the line)
DECISIVE_ROWS = [
    ("1. per optimizer step, replay can slightly hurt", "optimizer steps to first reach 0.45, "
     "replay / on-policy", "replay/on_policy", "log_step_ratio", "ratio", "above"),
    ("2. per generated token it learns faster (up to ~40% less compute)", "**generated tokens to "
     "first reach 0.45, replay / on-policy (the primary figure)**", "replay/on_policy",
     "log_token_ratio", "primary", "below"),
    ("", "the same, replay / its control (as many steps per token, no reuse)", "replay/control",
     "log_token_ratio", "ratio", "below"),
    ("", "mean accuracy over the evals (equal generated tokens), replay - on-policy",
     "replay/on_policy", "area_difference", "diff", "above"),
    ("", "generation + training to first reach, replay / on-policy, at docs/gpu.md's GPU cost "
     "ratio (generation {gpu:.1f}x training a rollout, the fast path; [against the ratio]"
     "(#does-replay-pay-at-your-cost-ratio-issue-67))", "replay/on_policy", "gpu_fast", "ratio",
     "below"),
    ("3. it preserves the policy's entropy", "sampling entropy over the second half (nats a token), "
     "replay - on-policy", "replay/on_policy", "entropy_second_half_difference", "diff", "not below"),
    ("", "the same, replay - its control", "replay/control", "entropy_second_half_difference",
     "diff", "not below"),
]


COST_RATIO = "docs/results/smollm2_decisive_cost_ratio.json"      # comparison/cost_ratio.py's


def decisive_table(path: str = DECISIVE, cost: str = COST_RATIO) -> str:
    """The four claims on the pre-registered SmolLM2 comparison: each figure per seed, its mean
    [90% paired t-interval] (ratios: exp of the mean log ratio), its one-sided p (t; sign-flip)
    toward the paper's side, and the verdict: the primary figure by the plan's rule at the look's
    alpha (a saving detected, a 40% saving excluded, or neither: the exclusion by the plan's 90%
    interval, said with the 95% one's, the look's alpha), the rest at both (at_alphas; not detected:
    with the seeds a 90%-power test at the look's alpha would need at the observed sd). The compute
    at a GPU's cost ratio is cost_ratio.py's (its JSON), at docs/gpu.md's fast-path ratio."""
    v, c = read(path), read(cost)["bases"]["rollouts"]
    n, alpha = len(v["seeds"]), v["alpha_this_look"]
    gpu = c["marked"]["gpu_fast"]
    lines = [f"| the paper's claim | measured as | SmolLM2-135M, sums ({n} RL seeds, paired) | "
             "one-sided p toward the paper (t; sign-flip) | verdict |", "|---|---|---|---|---|"]
    for claim, what, pair, key, kind, side in DECISIVE_ROWS:
        e = v["pairs"][pair]
        fig = gpu["log_compute_ratio"] if key == "gpu_fast" else e[key]
        ratio = kind != "diff"
        value = written(fig, "ratio" if ratio else "diff")
        below = side == "below"               # the p of the paper's direction
        p_t = fig["p_t"] if below else 1 - fig["p_t"]
        p_flip = fig["p_permutation"] if below else flipped_p(fig["values"])
        if kind == "primary":
            words = primary_words(e, fig, alpha)
        else:                       # a log ratio's line is 0 too: the page writes it as 1
            kind_ = "ratio" if ratio else "diff"
            words = at_alphas(fig, kind_, side, alpha) or (
                f"not detected (the mean breaks even at {c['break_even'][0]:.1f})"
                if key == "gpu_fast" else f"not detected ({needed(fig)} seeds for 90% power at "
                f"one-sided {alpha:g} at this sd)")
        if (pair, key) == ("replay/on_policy", "log_step_ratio") and "replay/control" in v["pairs"]:
            own = v["pairs"]["replay/control"][key]
            words += ("; **by construction** (S = 8: twice on-policy's steps per generated token); "
                      f"against the control, as many steps per token: {written(own, 'ratio')}, "
                      + (at_alphas(own, "ratio", side, alpha) or "not detected"))
        lines.append(f"| {claim} | {what.format(gpu=gpu['c'])} | {value} | {p_t:.3f}; "
                     f"{p_flip:.3f} | {words} |")
    return "\n".join(lines)


def primary_words(e: dict, fig: dict, alpha: float) -> str:
    """The plan's verdict on its primary figure: a saving detected (both p below the look's alpha),
    a 40% saving excluded (by the plan's rule, the 90% interval's low end above 0.60: a one-sided
    0.05 bound; said whether the look's 95% one is too), or neither, with the seeds."""
    if e["saving_detected"]:
        return f"**saving detected** (both p below {alpha:g}, this look's alpha)"
    if e["saving_of_40pct_excluded"]:
        lo90, lo95 = (math.exp(fig[f"interval_{k}"][0]) for k in (90, 95))
        head = f"**no saving detected at alpha {alpha:g}, this look's; a 40% saving excluded"
        if lo95 > 0.6:
            return f"{head}** (the 90% and 95% intervals' low ends above 0.60)"
        return (f"{head} at one-sided 0.05 only** (the plan's rule: the 90% interval's low end "
                f"{lo90:.2f} above 0.60; at {alpha:g} the 95% interval's, {lo95:.2f}, is not)")
    return (f"**not decided**: no saving detected at alpha {alpha:g}, a 40% saving not excluded; a "
            f"90%-power test at {alpha:g} would need {needed(fig)} seeds at this sd")


def decisive_pairs_table(path: str = DECISIVE) -> str:
    """Every pair of the pre-registered comparison, each figure its mean [90% paired t-interval]
    (ratios: exp of the mean log ratio): tokens, rollouts generated and steps to first reach 0.45
    (the tokens' one-sided p beside them), the mean accuracy over the evals, the second half's
    entropy, and generation + training to first reach at the generation / training cost per
    rollout measured in these runs and at 5x and 7x (the plan's ratios, named after the paper; no
    measurement in this repository gives them: cost_ratio.py for the rest)."""
    v = read(path)
    mu = next(iter(v["pairs"].values()))["mu"]["measured"]
    lines = ["| pair | tokens to first reach | one-sided p (t; sign-flip) | rollouts generated to "
             "first reach | steps to first reach | mean accuracy over the evals | entropy, second "
             f"half | compute to first reach, generation {mu:.2f}x training (measured) | 5x (the "
             "plan's ratios, not measured) | 7x |",
             "|" + "---|" * 10]
    show = lambda fig, kind="ratio": written(fig, kind)
    for pair, e in v["pairs"].items():
        t, c = e["log_token_ratio"], e["log_compute_ratio"]
        lines.append(f"| {pair.replace('/', ' / ')} | {show(t)} | {t['p_t']:.3f}; "
                     f"{t['p_permutation']:.3f} | {show(e['log_round_ratio'])} | {show(e['log_step_ratio'])} | "
                     f"{show(e['area_difference'], 'diff')} | "
                     f"{show(e['entropy_second_half_difference'], 'diff')} | "
                     + " | ".join(show(c[k]) for k in ("measured", "paper_5", "paper_7")) + " |")
    return "\n".join(lines)


DECISIVE_WALL = "docs/results/smollm2_decisive_wall.json"


def decisive_wall_table(path: str = DECISIVE_WALL) -> str:
    """The plan's wall-clock pair (compare_decisive.py --wall-clock --verdict): async replay against
    async on-policy, wall seconds (evals excluded) to first reach 0.45, mean [90% paired t-interval]
    of the log ratio as a ratio, its one-sided p (t; sign-flip), detected at 0.05 by both."""
    v = read(path)
    e = v["async_replay/on_policy"]
    fig = e["log_seconds_ratio"]
    cpu = [x for a in v["cpu_per_wall"].values() for x in a]
    reached = ", ".join(f"{a} {n} of {len(v['seeds'])}" for a, n in v["reached"].items())
    words = "a saving detected" if e["saving_detected"] else "no saving detected"
    return "\n".join([
        "| pair | seeds | reached 0.45 | wall seconds to first reach | one-sided p (t; sign-flip) "
        "| CPU / wall of the runs | at alpha 0.05 |", "|---|---|---|---|---|---|---|",
        f"| async replay / async on-policy | {len(v['seeds'])} | {reached} | "
        f"{written(fig, 'ratio')} | {fig['p_t']:.3f}; "
        f"{fig['p_permutation']:.3f} | {min(cpu):.2f}-{max(cpu):.2f} | {words} |"])


def needed(fig: dict) -> str:
    from compare_decisive import SEEDS_AT_MOST
    k = fig.get("seeds_for_90pct_power")
    return f"more than {SEEDS_AT_MOST}" if k is None else str(k)


def flipped_p(d: list[float]) -> float:
    """The exact sign-flip p of mean(d) > 0: compare_decisive.paired_test's (of mean < 0) on -d."""
    import compare_decisive
    return compare_decisive.paired_test([-x for x in d])["p_permutation"]


def arms_table(path: str = REAL) -> str:
    """Each arm of the real-model comparison as its summary gives it: the replay it measured (uses of
    a stored rollout, the share of generated ones stored, ages), reach, hold, fall, entropy, CPU
    seconds and seconds projected at a GPU's generation share (projections, not measurements)."""
    s = read(path)

    def ci(e, key, spec):
        lo, hi = e[f"{key}_ci"]
        f = lambda x: "not reached" if x is None else format(x, spec)
        return f"{f(e[key])} [{f(lo)}, {f(hi)}]"
    shares = list(next(iter(s["arms"].values()))["projected_seconds_to_target"])
    lines = ["| arm | N, S, B | uses of a stored rollout (lowest-highest run) | stored | age mean / max "
             "| tokens to first reach | tokens to hold | steps to hold | fall after reach | entropy "
             "| CPU s to hold | " + " | ".join(f"projected s to hold, {u}" for u in shares) + " |",
             "|" + "---|" * (11 + len(shares))]
    for arm, e in s["arms"].items():
        flags = e["flags"].split()
        size = lambda flag: flags[flags.index(flag) + 1]
        r = e["reuse"]
        proj = [e["projected_seconds_to_target"][u] for u in shares]
        lines.append(
            f"| {arm} | {size('--buffer-size')}, {size('--new-per-update')}, {size('--batch-size')} "
            f"| {r['uses_per_stored'][1]:.2f} ({r['uses_per_stored'][0]:.2f}-{r['uses_per_stored'][2]:.2f}) "
            f"| {100 * r['stored_frac']:.0f}% | {r['age_mean']:.2f} / {r['age_max']:g} "
            f"| {ci(e, 'tokens_to_first_reach', ',.0f')} | {ci(e, 'tokens_to_target', ',.0f')} "
            f"| {ci(e, 'steps_to_target', '.1f')} | {ci(e, 'instability', '.3f')} | {e['entropy']:.3f} "
            f"| {ci(e, 'cpu_seconds_to_target', ',.0f')} | "
            + " | ".join(ci({"x": p["seconds"], "x_ci": p["ci"]}, "x", ",.0f") for p in proj) + " |")
    return "\n".join(lines)


# y = 4 (issue 41's "if the budget allows"): its own comparison, whose on_policy is the same 5 records
Y4 = "docs/results/smollm2_y4.json"
Y4_PAIRS = [("replay_y4", "on_policy"), ("control_y4", "on_policy"), ("replay_y4", "control_y4"),
            ("replay_y4", "replay")]
PAIR_COLUMNS = [("tokens to first reach", "first_token_ratio", "ratio"), ("tokens to hold", "token_ratio", "ratio"),
                ("steps to hold", "step_ratio", "ratio"), ("final accuracy", "accuracy_diff", "diff"),
                ("fall after reach", "instability_diff", "diff"), ("entropy", "entropy_diff", "diff")]


def merged(paths: list[str]) -> dict:
    """One summary of several comparisons' arms, for pairs across them. They must share the target's
    runs (the same on_policy replicates) and the bootstrap, so every draw pairs the same seeds."""
    summaries = [read(p) for p in paths]
    first = summaries[0]
    for s in summaries[1:]:
        same = (s["arms"]["on_policy"]["replicates"] == first["arms"]["on_policy"]["replicates"]
                and s.get("target_frac", 1.0) == first.get("target_frac", 1.0)
                and s["args"]["bootstrap"] == first["args"]["bootstrap"])
        if not same:
            raise ValueError(f"{paths}: not the same on_policy runs, target or draws; no pair across them")
    return {**first, "arms": {a: e for s in summaries for a, e in s["arms"].items()}}


def pairs_table(paths: tuple = (Y4, REAL), pairs: tuple = tuple(Y4_PAIRS)) -> str:
    """Each pair's ratios (arm / reference) and differences (arm - reference), point [90% interval],
    recomputed from the summaries' replicates as the four claims' table is."""
    figs = pair_figures(merged(paths), pairs)
    lines = ["| arm vs reference | " + " | ".join(c[0] for c in PAIR_COLUMNS) + " |",
             "|" + "---|" * (1 + len(PAIR_COLUMNS))]
    for arm, ref in pairs:
        cells = [cell(figs, (None, None, arm, ref, key, kind, None)) for _, key, kind in PAIR_COLUMNS]
        lines.append(f"| {arm} vs {ref} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_shares(path: str, arms: tuple) -> list[float]:
    """Each run's CPU seconds over its wall seconds of generation and training, at its last eval,
    for the replicates of these arms of a summary: near 1, the run had a core to itself; well below
    1, it shared the cores with more processes than there were."""
    s = read(path)
    runs = [r for a in arms for r in s["arms"][a]["replicates"]]
    return sorted(r["cpu_seconds"][-1] / r["seconds"][-1] for r in runs)


def share_range(shares: list[float]) -> str:
    return f"{min(shares):.2f}-{max(shares):.2f}"


# the lr check: on_policy and replay, 2 RL seeds (0, 1), at half, once and twice the comparison's lr
LR_CHECK = {lr: f"docs/results/smollm2_lrcheck_{lr}.json" for lr in ("1.25e-4", "2.5e-4", "5e-4")}


def lr_table(paths: dict = LR_CHECK) -> str:
    """Replay against on-policy at each lr of the check, as point figures: with 2 replicates a
    bootstrap has 3 distinct draws, too few for an interval. Final accuracy (the median of the last
    three evals) per seed and on the mean curve, the mean accuracy over the evals (the area under
    the curve), tokens to hold on-policy's final accuracy (the ratio on the mean curves), entropy."""
    lines = ["| lr | final accuracy, on-policy (seeds 0, 1) | replay (seeds 0, 1) | replay - on-policy, "
             "seeds 0, 1 | mean accuracy over the evals, on-policy / replay | tokens to hold, replay / "
             "on-policy | entropy, on-policy / replay |", "|---|---|---|---|---|---|---|"]
    for lr, path in paths.items():
        s = read(path)
        runs = {arm: [{k: v for k, v in r.items() if k != "reach"} for r in s["arms"][arm]["replicates"]]
                for arm in ("on_policy", "replay")}
        final = {arm: [stats.final_accuracy(r["accuracy"]) for r in rs] for arm, rs in runs.items()}
        area = {arm: statistics.fmean(stats.sweep_score(r) for r in rs) for arm, rs in runs.items()}
        fig = stats.figures(runs, s.get("target_frac", 1.0), pairs=[("replay", "on_policy")])
        ratio = fig["arms"]["replay"]["vs"]["on_policy"]["token_ratio"]
        seeds = lambda xs, spec: ", ".join(format(x, spec) for x in xs)
        lines.append(
            f"| {lr} | {fig['arms']['on_policy']['final_accuracy']:.3f} ({seeds(final['on_policy'], '.3f')}) "
            f"| {fig['arms']['replay']['final_accuracy']:.3f} ({seeds(final['replay'], '.3f')}) "
            f"| {seeds([b - a for a, b in zip(final['on_policy'], final['replay'])], '+.3f')} "
            f"| {area['on_policy']:.3f} / {area['replay']:.3f} | {number(ratio, 'ratio')} "
            f"| {fig['arms']['on_policy']['entropy']:.3f} / {fig['arms']['replay']['entropy']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    argparse.ArgumentParser(prog="claims.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(decisive_table())
    print(f"\n{DECISIVE}, each pair:\n")
    print(decisive_pairs_table())
    print(f"\n{DECISIVE_WALL}, the wall-clock pair:\n")
    print(decisive_wall_table())
    print(f"\nthe earlier comparison, {REAL}:\n")
    print(table())
    print(f"\n{REAL}, per arm:\n")
    print(arms_table())
    print(f"\n{Y4}, per arm:\n")
    print(arms_table(Y4))
    print(f"\ny = 4: pairs across {Y4} and {REAL}:\n")
    print(pairs_table())
    print("\nthe lr check:\n")
    print(lr_table())
