"""What a summary of compare.py says: its tables (print_table), the answer to "which arm reaches
the target first, on this machine?" (print_answer; decide_points for a summary without its runs),
and its curves (plot, drawn by plot.py's plot_arms).
"""
from __future__ import annotations

import math

from plot import plot_arms
from stats import unit_costs


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
    rule = ("fixed before the runs" if s.get("target_fixed") else
            "on-policy final, median of its last 3 evals" if s.get("target_frac", 1.0) == 1.0 else
            f"on-policy start + {s['target_frac']:g} of its gain to its final accuracy")
    print(f"\nresults: {whose(s)}")
    print(f"target accuracy ({rule}): {s['target_accuracy']:.3f};  measured cost ratio "
          f"{s.get('cost_ratio', s.get('mu')):.2f} (generation / training seconds per rollout, a summary figure);  lr {s['lr_chosen_by']}: {s['lr']}")
    if "target_rule" in s:
        print(f"primary figure ({s['target_rule']}): {s['target_rules'][s['target_rule']]}")
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
        of = lambda key, spec=".2f": fmt_ci(p[key], p[key + "_ci"], spec)
        if "first_reach_time_ratio" in p:
            first += f"; wall time to first reach x{of('first_reach_time_ratio')}"
        if "first_reach_cpu_time_ratio" in p:
            first += f", CPU time x{of('first_reach_cpu_time_ratio')}"
        area = (f"; mean accuracy over the tokens (area) {of('area_diff', '+.3f')}"
                if "area_diff" in p else "")
        half = (f"; entropy over the second half {of('entropy_half_diff', '+.3f')}"
                if "entropy_half_diff" in p else "")
        return (f"tokens to hold the target x{fmt_ci(p['token_ratio'], p['token_ratio_ci'])}; measured time "
                f"x{fmt_ci(p['time_ratio'], p['time_ratio_ci'])}{cpu}{proj}{first}; final accuracy "
                f"{fmt_ci(p['accuracy_diff'], p['accuracy_diff_ci'], '+.3f')}{area}; entropy "
                f"{fmt_ci(p['entropy_diff'], p['entropy_diff_ci'], '+.3f')}{half}")

    def differs(p: dict) -> str:
        d = p.get("differs")
        return "" if d is None else "\n    flags that differ: " + (
            ", ".join(f"{k} {a} vs {b}" for k, (a, b) in d.items()) or "none")
    print("\nagainst on_policy, point [90% interval over replicates]; measured time: seconds in the runs' logs; "
          "projected: the runs' rounds and steps to the target charged at the cost curve's seconds")
    for name, a in s["arms"].items():
        if name != "on_policy":
            print(f"{name}: {ratios(a)} -> {a['verdict']}{differs(a)}")
    paired = {name: a["vs_control"] for name, a in s["arms"].items() if "vs_control" in a}
    if paired:
        print("\nreplay against its own control (R = B = N = B/y: as many updates per generated token, no reuse), "
              "paired draws (replicate i of both in each draw, the ratio taken within it)")
    for name, p in paired.items():
        verdict = f" -> {p['verdict']}" if "verdict" in p else ""
        print(f"{name} / {p['arm']}: {ratios(p)}{verdict}{differs(p)}")
    other = [(name, ref, p) for name, a in s["arms"].items()
             for ref, p in a.get("vs_other", {}).items()]
    if other:
        print("\nthe other pairs (--pairs), paired draws")
    for name, ref, p in other:
        print(f"{name} / {ref}: {ratios(p)} -> {p['verdict']}{differs(p)}")
    bigger = {name: a["vs_smaller_buffer"] for name, a in s["arms"].items() if "vs_smaller_buffer" in a}
    if bigger:
        print("\nthe larger buffer against the smaller (the same uses, older rollouts), paired draws")
    for name, p in bigger.items():
        print(f"{name} / {p['arm']}: {ratios(p)} -> {p['verdict']}{differs(p)}")
    print(f"best replay arm (tokens): {s['best_replay_arm']}")
    counted = {name: a["rounds"] for name, a in s["arms"].items() if "rounds" in a}
    if counted:
        print("\nthe rounds, counted from the records' rows (summed over replicates): generated, "
              "of zero advantage, stored, discarded by the cap; rounds, empty ones, ones that "
              "discarded")
    for name, c in counted.items():
        print(f"{name}: {c['generated']} generated, {c['zero_advantage']} zero-advantage, "
              f"{c['stored']} stored, {c['discarded']} discarded (per replicate "
              f"{c['discarded_per_replicate']}); {c['rounds']} rounds, {c['empty_rounds']} empty, "
              f"{c['discard_rounds']} with discards")
    possible = [name for name, a in s["arms"].items() if a.get("discards_possible")]
    if possible:
        print(f"can discard what they generated (the synchronous cap): {', '.join(possible)}")
    reuse = {name: a["reuse"] for name, a in s["arms"].items() if "reuse" in a}
    if reuse:
        print("\nreplay as measured: uses of a stored rollout (trained on / stored: lowest, mean, highest "
              "replicate), share of the generated stored, rollouts gone by uses [unused, once, ...], ages")
    for name, r in reuse.items():
        lo, mean, hi = r["uses_per_stored"]
        print(f"{name}: used {mean:.2f} times ({lo:.2f}-{hi:.2f}), {100 * r['stored_frac']:.0f}% stored, "
              f"gone by uses {r['left_by_uses']}, age {r['age_mean']:.2f} mean, {r['age_max']} max"
              + (f"  {r['flag']}" if "flag" in r else ""))


# ---- the answer to the user's question: which arm reaches the target first here ---------------
def print_answer(s: dict, answer: dict, cost_path: str = "") -> None:
    """compare.decide's answer, one line per basis: which arm reaches the target first, in how many
    seconds, and each other arm's time as a ratio to it (with its interval, where there is one)."""
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


def decide_points(s: dict, cost: dict | None) -> dict:
    """compare.decide for a summary without per-replicate runs: point figures from each arm's
    counts to the target (R from its flags; G from on_policy's, whose R = B), no intervals."""
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
    if plot_arms(s, path) is not None:
        print(f"curves: {path}")
