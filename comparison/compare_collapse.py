"""Issue 59, part 2: why the paper's sampler collapsed on SmolLM2. Four arms of the synchronous
loop separate reuse from staleness, and the clipped loss from the truncated-IS one; the plan, the
definition of a collapse and the verdict rule are in docs/plans/smollm2_collapse.md, committed
before the first run.

    python comparison/compare_collapse.py --print     # the compare.py command, nothing run
    python comparison/compare_collapse.py             # 4 arms x 3 seeds, two runs at a time
    python comparison/compare_collapse.py --verdict   # the plan's verdict, from the records:
                                                      # docs/results/smollm2_collapse.json, .png

Every arm: SmolLM2-135M-Instruct, --task sums, one prompt a round (P = 1) of G = 4 at T = 0.7, no
zero-advantage filter, B = 16, lr 2.5e-4, 6,000 generated tokens, greedy evals on 100 fixed
prompts at 0, 1,000, ..., 6,000 tokens: the setting of the async SmolLM2 comparison
(compare_async.py smollm2), whose synchronous on-policy records (seeds 0-2, deterministic) are
this comparison's reference, read from their records, not run again.
  on_policy    N = B = S = 16: a step once 16 new rollouts are in, each used once at age 0
  reuse_fresh  reuse without staleness: N = B = 16, S = 4 (a step each round): each rollout used
               4 times, at ages 0-3
  stale_once   staleness without reuse: N = 128, S = B = 16, --no-reuse, --learning-starts 128: a
               backlog of 128 from which each step draws 16 uniformly and removes them; each used
               once, at a mean age of about 7 (the sampler's was 7.3). Its first 128 rollouts
               (about 2,200 tokens) are generated before its first step
  sampler_tis  both, as the sampler had them: N = 64, a step each round: each used 4 times, at
               ages 0-15 (mean about 7.5), the truncated-IS loss (C = 2)
  sampler_ppo  sampler_tis with the paper's clipped loss (epsilon 0.2)
Two runs side by side, one torch thread each (--jobs 2): token figures only, no wall seconds.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

RECORDS = "docs/results/records/smollm2_collapse"
SHARED = "--prompts-per-round 1 --no-skip-zero-advantage --batch-size 16"
ARMS = {
    "on_policy": "--buffer-size 16 --new-per-update 16",
    "reuse_fresh": "--buffer-size 16 --new-per-update 4",
    "stale_once": "--buffer-size 128 --new-per-update 16 --no-reuse --learning-starts 128",
    "sampler_tis": "--buffer-size 64",
    "sampler_ppo": "--buffer-size 64 --loss ppo",
}
PAIRS = ("reuse_fresh:on_policy", "stale_once:on_policy", "sampler_tis:on_policy",
         "sampler_tis:reuse_fresh", "sampler_tis:stale_once", "sampler_ppo:sampler_tis")
START, BAND = 0.15, 0.05    # every run's accuracy at step 0; a lasting gain: above START + BAND
KL_RISE = 0.05                  # approx_kl above this: the policy moved far from its samplers


def compare_argv() -> list[str]:
    argv = ["--model", "smollm2", "--task", "sums", "--num-generations", "4", "--batch-size", "16",
            "--lr", "2.5e-4", "--seeds", "3", "--budget-tokens", "6000", "--early-tokens", "3000",
            "--early-evals", "3", "--evals", "3", "--eval-prompts", "100", "--target", "0.45",
            "--target-rule", "first", "--train-args", "--temperature 0.7", "--arms", *ARMS]
    for name, flags in ARMS.items():
        argv += ["--arm", name, f"{SHARED} {flags}"]
    return argv + ["--pairs", *PAIRS, "--jobs", "2", "--records", RECORDS,
                   "--output-dir", "runs/smollm2_collapse"]


def traces(record_path: str) -> dict:
    """A run's step rows over generated tokens: approx_kl, the sampling entropy of the round, the
    largest importance ratio, the truncated (tis) or clipped (ppo) share."""
    with gzip.open(record_path[:-len(".json")] + ".metrics.jsonl.gz", "rt") as f:
        steps = [r for r in map(json.loads, f) if "loss" in r]
    return {k: [r.get(key, 0.0) for r in steps] for k, key in (
        ("tokens", "gen_tokens"), ("kl", "approx_kl"), ("entropy", "rollout_entropy"),
        ("is_ratio_max", "is_ratio_max"), ("truncated", "is_truncated_frac"))}


def plot(fig: dict, path: str) -> None:
    """Accuracy at the evals, approx_kl and the sampling entropy at each step, over generated
    tokens: one panel each, one colour an arm, one line a seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = plt.subplots(1, 3, figsize=(15, 4))[1]
    for colour, (arm, runs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], fig.items()):
        for i, r in enumerate(runs):
            label = arm if i == 0 else None
            panels[0].plot(r["eval_tokens"], r["evals"], color=colour, label=label, alpha=0.8)
            panels[1].plot(r["trace"]["tokens"], r["trace"]["kl"], color=colour, alpha=0.8)
            panels[2].plot(r["trace"]["tokens"], r["trace"]["entropy"], color=colour, alpha=0.8)
    for ax, title in zip(panels, ("eval accuracy (greedy, 100 prompts)",
                                  "approx_kl, KL(mu || pi_theta) on the batch (log scale)",
                                  "sampling entropy of the round (nats/token)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("generated tokens")
    panels[1].set_yscale("symlog", linthresh=0.01)
    panels[0].legend(fontsize=8)
    plt.tight_layout()
    plt.savefig(path, dpi=80)


def run_figures(record_path: str) -> dict:
    """One run's figures for the verdict, from its record and the metrics rows beside it."""
    record = json.load(open(record_path))
    with gzip.open(record_path[:-len(".json")] + ".metrics.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "loss" in r]
    acc = [e["eval_accuracy"] for e in record["evals"]]
    kl = [r.get("approx_kl", 0.0) for r in steps]
    rise = next((i + 1 for i, k in enumerate(kl) if k > KL_RISE), None)
    return {"seed": record["config"]["seed"], "evals": acc, "trace": traces(record_path),
            "eval_tokens": [e["gen_tokens"] for e in record["evals"]],
            "final2": statistics.fmean(acc[-2:]),
            "collapsed": statistics.fmean(acc[-2:]) <= START + BAND, "steps": len(steps),
            "kl_max": max(kl), "kl_mean": statistics.fmean(kl), "kl_rise_step": rise,
            "tokens_at_kl_rise": steps[rise - 1]["gen_tokens"] if rise else None,
            "entropy_second_half": record["entropy_second_half"],
            "is_ratio_max": record["staleness"]["is_ratio_max"],
            "truncated_frac": record["staleness"]["truncated_frac"],
            "age_mean": record["staleness"]["age_mean"],
            "uses": (record["reuse"]["rollouts_trained"] / record["reuse"]["rollouts_stored"]),
            "first_reach_045": next((e["gen_tokens"] for e in record["evals"]
                                     if e["eval_accuracy"] >= 0.45), None)}


def figures(records: str = RECORDS) -> dict:
    """{arm: [each seed's run_figures]} of the records there are."""
    out = {}
    for arm in ARMS:
        paths = sorted(glob.glob(os.path.join(ROOT, records, arm, "seed*-*.json")))
        out[arm] = [run_figures(p) for p in paths if not p.endswith(".metrics.json")]
    return out


def verdict(fig: dict) -> list[str]:
    """The plan's rule (docs/plans/smollm2_collapse.md), applied: an arm collapses when at least 2
    of its 3 seeds did; then which explanation the pattern supports, and the loss for the decisive
    comparison."""
    n = {arm: sum(r["collapsed"] for r in runs) for arm, runs in fig.items()}
    done = {arm: len(runs) for arm, runs in fig.items()}
    if any(done[a] < 3 for a in ARMS):
        return [f"not all runs are in: {done}"]
    c = {arm: n[arm] >= 2 for arm in n}
    lines = [f"collapsed seeds of 3: {n}"]
    if c["on_policy"]:
        lines.append("on-policy collapsed: the setting itself is unstable; no explanation read")
    elif not c["sampler_tis"]:
        lines.append("sampler_tis did not collapse: the synchronous form does not reproduce the "
                     "collapse (reuse 4 at ages 0-15); neither explanation is supported by these "
                     "runs")
    elif c["reuse_fresh"] and not c["stale_once"]:
        lines.append("supported: too much movement per generated token (reuse), not staleness")
    elif c["stale_once"] and not c["reuse_fresh"]:
        lines.append("supported: staleness bias, not reuse")
    elif c["stale_once"] and c["reuse_fresh"]:
        lines.append("each alone suffices: reuse and staleness both collapse the run")
    else:
        lines.append("supported: the two together (neither alone collapses the run)")
    if c["sampler_tis"] and not c["sampler_ppo"]:
        lines.append("the clipped loss prevented the collapse the truncated-IS loss had")
    elif c["sampler_tis"] and c["sampler_ppo"]:
        lines.append("the clipped loss did not prevent the collapse")
    loss = "tis" if c["sampler_ppo"] and not c["sampler_tis"] else "ppo"
    lines.append(f"the decisive comparison's replay arms: --loss {loss}, lr 2.5e-4")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(prog="compare_collapse.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--print", action="store_true", help="print the command and run nothing")
    p.add_argument("--verdict", action="store_true", help="the plan's verdict from the records")
    args = p.parse_args(argv)
    if args.verdict:
        fig = figures()
        for arm, runs in fig.items():
            for r in runs:
                print(arm, json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                       for k, v in r.items() if k not in ("evals", "trace",
                                                                          "eval_tokens")}))
        lines = verdict(fig)
        print("\n".join(lines))
        out = os.path.join(ROOT, "docs", "results", "smollm2_collapse")
        with open(out + ".json", "w") as f:
            json.dump({"plan": "docs/plans/smollm2_collapse.md", "records": RECORDS,
                       "verdict": lines, "runs": fig}, f, indent=1)
        plot(fig, out + ".png")
        return fig
    import compare
    return compare.print_or_run(compare_argv(), args.print)


if __name__ == "__main__":
    main()
