"""Synchronous rounds against generation workers (train.py --generators 1), side by side.

    python benchmarks/async_throughput.py                       # --model smollm2's settings, CPU
    python benchmarks/async_throughput.py --setting heavy       # generation-heavy: long completions
    python benchmarks/async_throughput.py --setting demo --pairs 1 --rounds 20     # a quick look

Each pair runs, back to back and alternating which goes first, the same settings twice:
  sync   train.py as it is: generate a round, then its step, on all the cores (--sync-threads);
  async  train.py --generators 1: one worker process generates while the trainer steps, the cores
         shared out (one each on 2 cores),
at S = B (async on-policy: a step per round, each rollout used once) and at S = 0 (the paper's
sampler: the trainer never waits for new rollouts). Every figure is read from the runs'
metrics.jsonl over their steady state (from the first optimizer step to the last before the budget
shows: see run()), not from a clock of this script's:
  steps_per_s, tokens_per_s    optimizer steps and generated completion tokens per wall second
                               (each loop's own wall clock, wall_seconds: evals excluded)
  replay_ratio, age_mean       rollouts trained on / stored; their mean age at training (steps)
  trainer_idle, worker_idle    async: the share of wall time the trainer waited for rollouts, and
                               the worker for an order (no room in the buffer) or for weights
  ideal_steps_per_s            one step per max(k * g, t), with g a round's generation, k the rounds
                               per step and t a step, as this async run measured them (one thread
                               each): the perfect overlap; async_of_ideal = steps_per_s / it.
                               Where generation bounds (k * g > t) it equals the generation
                               seconds of the rounds received in the window over the window's
                               seconds: above 1 when rounds made before the window arrive in it
                               (the trainer keeps rounds on their way), by one round in as many as
                               the window holds
The goals of issue 51: at S = B async_of_ideal >= 0.95; at S = 0 trainer_idle <= 0.05. Run it with
nothing else on the cores (the script prints the load it found and the CPU/wall of each run).
The last line is one JSON object with every run and every ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import async_rl  # noqa: E402  (rounds_ahead: where a run's steady state ends)
EVALS_OFF = ["--eval-every", "1000000", "--eval-prompts", "1", "--no-progress", "--no-plot"]
# Each setting: (flags of both arms, B). smollm2: its own defaults (4 prompts x 4) without the
# zero-advantage filter, so every round stores R = B = 16 and S = B is one step per round; heavy:
# one prompt a round (R = 4), four rounds a step: a decode step on this CPU costs about the same for
# 4 sequences as for 16 (it reads the weights either way), so a rollout costs about 3x more to
# generate than to train on (comparison/cost.py: 18.5 s for 4 completions of 128 tokens, 6.5 s for
# a step on them, one thread): the paper's regime, where generation dominates; demo: the tiny
# model, for a quick look. --flags replaces a setting's (e.g. a GPU model), --batch-size its B.
SETTINGS = {
    "smollm2": (["--model", "smollm2", "--no-skip-zero-advantage"], 16),
    "heavy": (["--model", "smollm2", "--no-skip-zero-advantage", "--prompts-per-round", "1"], 16),
    "demo": (["--model", "tiny", "--prompts-per-round", "32", "--task", "columns"], 256),
    "gpu": ([], 64),            # benchmarks/gpu_async.sh gives its flags
}


def arms(setting: str, S: int) -> dict[str, list[str]]:
    flags, B = SETTINGS[setting]
    if S:                       # S = B = N: on-policy, one step per round in both
        shape = ["--batch-size", str(B), "--buffer-size", str(B), "--new-per-update", str(B)]
        return {"sync": flags + shape, "async": flags + shape + ["--generators", "1"]}
    shape = ["--batch-size", str(B), "--buffer-size", str(2 * B)]      # the paper's trainer, below
    return {"sync": flags + shape,
            "async": flags + shape + ["--generators", "1", "--step-when-held"]}


def run(flags: list[str], rounds: int, threads: int, seed: int) -> dict:
    """One train.py run in a fresh process; its steady-state figures from metrics.jsonl."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        cpu0, wall0 = os.times(), time.perf_counter()
        done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *flags, *EVALS_OFF,
                               "--max-rounds", str(rounds), "--seed", str(seed),
                               "--output-dir", out], env=env, capture_output=True, text=True)
        cpu1, wall = os.times(), time.perf_counter() - wall0
        if done.returncode:
            sys.exit(f"error: train.py {' '.join(flags)} failed:\n{done.stderr[-2000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
    # The steady state ends where the budget starts to show: the trainer keeps rounds_ahead rounds
    # on their way, so once more than rounds - that many have arrived, no more are ordered, the
    # worker runs out of work, and the last steps come from rounds made during earlier steps. Both
    # loops' windows end at the last step before that.
    ahead = async_rl.rounds_ahead(max(cfg["generators"], 1), cfg["batch_size"],
                                  cfg["prompts_per_round"] * cfg["num_generations"])
    steps = [r for r in rows if "is_ratio_mean" in r and r["round"] <= rounds - ahead]
    if len(steps) < 3:
        sys.exit(f"error: {rounds} rounds leave {len(steps)} steps before the budget shows "
                 f"(rounds - {ahead}); give more --rounds")
    first, last = steps[0], steps[-1]
    asynchronous = "trainer_wait_seconds" in last
    clock = lambda r: r["wall_seconds"]         # the loop's wall clock, evals excluded, both loops
    seconds = clock(last) - clock(first)
    n_steps, rounds_done = last["step"] - first["step"], last["round"] - first["round"]
    figures = {"steps": n_steps, "seconds": seconds, "steps_per_s": n_steps / seconds,
               "tokens_per_s": (last["gen_tokens"] - first["gen_tokens"]) / seconds,
               "replay_ratio": last["rollouts_trained"] / max(last["rollouts_stored"], 1),
               "age_mean": statistics.mean(r["age_mean"] for r in steps),
               "cpu_per_wall": ((cpu1.children_user + cpu1.children_system)
                                - (cpu0.children_user + cpu0.children_system)) / wall}
    gen_per_round = (last["gen_seconds"] - first["gen_seconds"]) / max(rounds_done, 1)
    train_per_step = (last["train_seconds"] - first["train_seconds"]) / max(n_steps, 1)
    rounds_per_step = rounds_done / max(n_steps, 1)
    figures.update(gen_per_round=gen_per_round, train_per_step=train_per_step,
                   rounds_per_step=rounds_per_step)
    if asynchronous:
        span = seconds or 1e-9
        figures.update(
            trainer_idle=(last["trainer_wait_seconds"] - first["trainer_wait_seconds"]) / span,
            worker_room_idle=(last["worker_room_wait_seconds"]
                              - first["worker_room_wait_seconds"]) / span,
            worker_weights_idle=(last["worker_weights_wait_seconds"]
                                 - first["worker_weights_wait_seconds"]) / span,
            ideal_steps_per_s=1 / max(gen_per_round * rounds_per_step, train_per_step))
        figures["async_of_ideal"] = figures["steps_per_s"] / figures["ideal_steps_per_s"]
    return figures


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=SETTINGS, default="smollm2")
    p.add_argument("--pairs", type=int, default=3, help="interleaved sync/async pairs per S")
    p.add_argument("--rounds", type=int, default=8, help="rounds per run")
    p.add_argument("--sync-threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the synchronous run (the async run shares the cores out)")
    p.add_argument("--s", default="B,0", help="which S to run: B, 0 or both (B,0)")
    p.add_argument("--flags", default="", help="train.py flags of both arms instead of the "
                   "setting's (with --batch-size: B)")
    p.add_argument("--batch-size", type=int, default=0, help="B with --flags")
    args = p.parse_args(argv)
    if args.flags:
        SETTINGS[args.setting] = (args.flags.split(), args.batch_size or 16)
    _, B = SETTINGS[args.setting]
    results = {"setting": args.setting, "flags": SETTINGS[args.setting][0], "pairs": args.pairs,
               "rounds": args.rounds, "load_before": load_average(), "runs": {}, "ratios": {}}
    print(f"load average before: {results['load_before']:.2f} on {os.cpu_count()} cores "
          "(a figure counts only with the cores otherwise quiet)", file=sys.stderr)
    for S in [B if s.strip() == "B" else 0 for s in args.s.split(",")]:
        key = f"S={S}"
        both = arms(args.setting, S)
        runs = {"sync": [], "async": []}
        for i in range(args.pairs):
            order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
            for name in order:
                figures = run(both[name], args.rounds, args.sync_threads if name == "sync" else 1,
                              seed=i)
                runs[name].append(figures)
                print(f"{args.setting} {key} pair {i} {name}: {json.dumps(figures)}",
                      file=sys.stderr, flush=True)
        results["runs"][key] = runs
        results["ratios"][key] = ratios(runs)
        print(table(key, runs, results["ratios"][key]))
    results["load_after"] = load_average()
    print(json.dumps(results))
    return results


def ratios(runs: dict) -> dict:
    """async / sync per pair (steps and tokens per wall second), and the async run's own shares."""
    pairs = list(zip(runs["sync"], runs["async"]))
    out = {"async_over_sync_steps": [a["steps_per_s"] / s["steps_per_s"] for s, a in pairs],
           "async_over_sync_tokens": [a["tokens_per_s"] / s["tokens_per_s"] for s, a in pairs],
           "async_of_ideal": [a["async_of_ideal"] for _, a in pairs],
           "ideal_over_sync_steps": [a["ideal_steps_per_s"] / s["steps_per_s"] for s, a in pairs],
           "trainer_idle": [a["trainer_idle"] for _, a in pairs],
           "replay_ratio": [a["replay_ratio"] for _, a in pairs]}
    return {k: {"pairs": v, "median": statistics.median(v)} for k, v in out.items()}


def table(key: str, runs: dict, r: dict) -> str:
    lines = [f"{key}: median over {len(runs['sync'])} pair(s)"]
    for name in ("sync", "async"):
        med = lambda k: statistics.median(x[k] for x in runs[name])
        lines.append(f"  {name:5s}  steps/s {med('steps_per_s'):.3f}  tokens/s "
                     f"{med('tokens_per_s'):.1f}  gen/round {med('gen_per_round'):.2f} s  "
                     f"step {med('train_per_step'):.2f} s  uses {med('replay_ratio'):.2f}  "
                     f"age {med('age_mean'):.2f}  CPU/wall {med('cpu_per_wall'):.2f}")
    lines.append(f"  async/sync steps per s {r['async_over_sync_steps']['median']:.2f} (ideal "
                 f"overlap {r['ideal_over_sync_steps']['median']:.2f}); async at "
                 f"{r['async_of_ideal']['median']:.2f} of its ideal; trainer idle "
                 f"{r['trainer_idle']['median']:.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
