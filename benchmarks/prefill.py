"""Each prompt prefilled once (generation.prefill_once, the default) against ``generate`` given G
copies of each prompt (shared_prefill=False), side by side in one process, one thread, interleaved
(plain, shared; then shared, plain; ...) with the same seed for both of a pair, so that a load on
the machine falls on both alike. Writes docs/results/prefill_cpu.json.

    python benchmarks/prefill.py                          # every setting, ~10 min on a loaded core
    python benchmarks/prefill.py --settings smollm2 demo  # some (the file keeps the others)
    python benchmarks/prefill.py --parts trl              # train.py beside TRL's GRPOTrainer

  rounds    generate_rollouts: rollouts per second, and per phase the seconds and the tokens per
            second that the model computed: prefill (every forward before the first sampled token
            goes back in: the prompts' tokens, padding included) and decode (one token a row a
            step); the rest (sampling, the recorder, Python) is "other". Settings:
              smollm2      train.py --model smollm2's: 4 sums prompts x G = 4 in the chat template
                           (47 tokens, 27 of them the same in every prompt), T = 0.7, 48 new tokens
              one_prompt   1 prompt x G = 16, otherwise as smollm2
              long_prompt  2 prompts x G = 8 of 189 tokens: a few-shot prefix of 5 worked sums
                           before the question (166 tokens shared), as GSM8K with few-shot examples
              demo         python train.py's: the tiny model, 16 prompts x G = 8, 5 new tokens
  evals     generation.greedy_rewards (train.py's eval): seconds, plain (one generate call) against
            shared (prefill_once, and greedy_completions: a reply leaves the batch once it ended,
            generate run 8 tokens at a time), and the same phases: smollm2 (100 held-out
            prompts, 48 new tokens), long_prompt (32 prompts), demo (500 prompts)
  trl       train.py --model smollm2 (the shared prefill), the same with --shared-prefix, and
            TRL's GRPOTrainer (benchmarks/chunked_logp.py's harness), each a fresh process, one
            thread, in interleaved order; seconds per step (16 rollouts, then one update).
            TRL: pip install --no-deps trl (1.16.0 here, into a folder on PYTHONPATH)

Load: the process's CPU seconds over wall seconds and os.getloadavg() before and after are kept
with the figures; on a loaded machine the ratios of a pair are the figure to read, not the times.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

OUTPUT = os.path.join(ROOT, "docs", "results", "prefill_cpu.json")
LOAD_NOTE = "cores not quiet (an experiment ran beside it)"     # --quiet-cores: nothing else ran
SETTINGS = {"smollm2": dict(model="smollm2", prompts=4, generations=4, few_shot=0),
            "one_prompt": dict(model="smollm2", prompts=1, generations=16, few_shot=0),
            "long_prompt": dict(model="smollm2", prompts=2, generations=8, few_shot=5),
            "demo": dict(model="tiny", prompts=16, generations=8, few_shot=0, pairs=20)}
EVALS = {"smollm2": 100, "long_prompt": 32, "demo": 500}


class Phases:
    """Times each forward of the model (wall and CPU seconds, the tokens of its input) by hooks:
    a forward outside ``generate`` (prefill_once's) or the first inside it is prefill, the rest
    of generate's are decode steps."""

    def __init__(self, model):
        from infra import generation
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.register_forward_pre_hook(self.before, with_kwargs=True)
        base.register_forward_hook(self.after, with_kwargs=True)
        generate, prefill_once = base.generate, generation.prefill_once

        def timed_generate(*args, **kwargs):      # PEFT's generate calls the base model's
            # its first forward runs the prompts' last column, unless it continues a batch
            # (greedy_completions: the same batch after prefill_once, its ended rows dropped)
            self.state = "first" if self.new_batch or not self.shared else "rest"
            self.new_batch = False
            try:
                return generate(*args, **kwargs)
            finally:
                self.state = "outside"

        def counted_prefill_once(*args, **kwargs):
            self.shared = self.new_batch = True
            return prefill_once(*args, **kwargs)
        base.generate, generation.prefill_once = timed_generate, counted_prefill_once
        self.state, self.calls, self.shared, self.new_batch = "outside", [], False, False

    def before(self, module, args, kwargs):
        self.start = (time.perf_counter(), time.process_time())

    def after(self, module, args, kwargs, output):
        phase = "decode" if self.state == "rest" else "prefill"
        self.state = "rest" if self.state in ("first", "rest") else "outside"
        self.calls.append((phase, time.perf_counter() - self.start[0],
                           time.process_time() - self.start[1], kwargs["input_ids"].numel(),
                           kwargs["input_ids"].shape[0]))

    def split(self, total_s: float) -> dict:
        """Seconds, CPU seconds, tokens and forwards of each phase; prefix_s: the shared prefix's
        forward (prefill_once's first, of batch 1), what keeping its cache would save a call."""
        out = {}
        for name in ("prefill", "decode"):
            calls = [c for c in self.calls if c[0] == name]
            out.update({f"{name}_s": sum(c[1] for c in calls),
                        f"{name}_cpu_s": sum(c[2] for c in calls),
                        f"{name}_tokens": sum(c[3] for c in calls), f"{name}_forwards": len(calls)})
        first = self.calls[0]
        out["prefix_s"] = first[1] if first[0] == "prefill" and first[4] == 1 else 0.0
        out["other_s"] = total_s - out["prefill_s"] - out["decode_s"]
        return out


def phases_of(model) -> Phases:
    if not hasattr(model, "_phases"):
        model._phases = Phases(model)
    model._phases.calls, model._phases.shared, model._phases.new_batch = [], False, False
    return model._phases


def few_shot_prompts(task, tokenizer, n: int, count: int, seed: int = 0) -> dict[str, str]:
    """{chat-template prompt: its question}: n worked sums (the same for every prompt), then the
    question."""
    import random
    rng = random.Random(seed)
    shots = rng.sample(task.train_prompts, n)
    prefix = "".join(f"Q: {p}\nA: {task.answers[p]}\n\n" for p in shots)
    questions = rng.sample([p for p in task.train_prompts if p not in shots], count)
    return {tokenizer.apply_chat_template([{"role": "user", "content": f"{prefix}Q: {q}\nA:"}],
                                          tokenize=False, add_generation_prompt=True): q
            for q in questions}


def load(model_name: str):
    """(model, tokenizer, task, cfg) as train.py loads them (chat template, LoRA r 16, fp32)."""
    from infra import loading
    from infra import report
    import train
    report.quiet_libraries()
    argv = [] if model_name == "tiny" else ["--model", model_name]
    cfg = train.parse_config(argv + ["--no-progress", "--device", "cpu"])
    task = loading.load_task(cfg, training=False)
    model, tokenizer, task = loading.load_model(cfg, task, "cpu", 0)
    model.eval()
    return model, tokenizer, task, cfg


def prompts_of(setting: dict, task, tokenizer, count: int, seed: int, eval_set: bool = False):
    """(prompts, their reward): the task's (held-out ones for an eval), or few-shot ones."""
    import random

    import tasks
    if setting["few_shot"]:
        plain = tasks.load_task(task.name)          # before the chat template
        questions = few_shot_prompts(plain, tokenizer, setting["few_shot"], count, seed)
        return list(questions), lambda p, c: plain.reward(questions[p], c)
    pool = task.eval_prompts if eval_set else task.train_prompts
    return (pool[:count] if eval_set else random.Random(seed).sample(pool, count)), task.reward


def prefix_length(tokenizer, prompts: list[str]) -> tuple[int, int]:
    """(tokens every prompt starts with, the longest prompt's tokens)."""
    rows = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    S = 0
    while S < min(map(len, rows)) - 1 and all(r[S] == rows[0][S] for r in rows):
        S += 1
    return S, max(map(len, rows))


def one_round(model, tokenizer, task, cfg, prompts, reward, G, shared: bool, seed: int) -> dict:
    import rollout
    from infra import generation
    phases = phases_of(model)
    torch.manual_seed(seed)
    wall, cpu = time.perf_counter(), time.process_time()
    rollouts, stats = rollout.generate_rollouts(
        model, tokenizer, prompts, reward, num_generations=G,
        max_new_tokens=cfg.max_new_tokens or task.max_new_tokens, temperature=cfg.temperature,
        policy_version=0, sampler=generation.recording_sampler(shared_prefill=shared))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"s": wall, "cpu_s": cpu, "rollouts_per_s": len(rollouts) / wall, **phases.split(wall),
            "new_tokens": stats["new_tokens"],
            "completions": [r.completion_ids.tolist() for r in rollouts],
            "logp": [r.behaviour_logp for r in rollouts]}


def one_eval(model, tokenizer, task, cfg, prompts, reward, shared: bool) -> dict:
    from infra import generation
    phases = phases_of(model)
    texts = []
    fns = {"reward": lambda p, c: texts.append(c) or float(reward(p, c))}
    wall, cpu = time.perf_counter(), time.process_time()
    means = generation.greedy_rewards(model, tokenizer, prompts, fns,
                                   max_new_tokens=cfg.max_new_tokens or task.max_new_tokens,
                                   shared_prefill=shared, drop_ended=shared)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    # the tokens the replies hold, about (decoded text encoded again), the end token counted
    kept = sum(len(tokenizer(t, add_special_tokens=False).input_ids) + 1 for t in texts)
    return {"s": wall, "cpu_s": cpu, **phases.split(wall), "accuracy": means["reward"],
            "new_tokens_about": kept,
            "texts": texts}


def summarize(runs: dict, keep_first: bool = False) -> dict:
    """Medians of each figure over the pairs (the warm-up pair left out), and shared / plain."""
    out = {}
    for name in ("plain", "shared"):
        rows = runs[name] if keep_first else runs[name][1:]
        figures = {k for k, v in rows[0].items() if isinstance(v, (int, float))}
        out[name] = {k: round(statistics.median(r[k] for r in rows), 4) for k in sorted(figures)}
        out[name]["s_each"] = [round(r["s"], 3) for r in rows]
        for phase in ("prefill", "decode"):
            if out[name][f"{phase}_s"] > 0:
                out[name][f"{phase}_tokens_per_s"] = round(
                    out[name][f"{phase}_tokens"] / out[name][f"{phase}_s"], 1)
    pairs = list(zip(runs["plain"], runs["shared"]))[0 if keep_first else 1:]
    out["speedup_wall"] = round(statistics.median(p["s"] / s["s"] for p, s in pairs), 3)
    out["speedup_cpu"] = round(statistics.median(p["cpu_s"] / s["cpu_s"] for p, s in pairs), 3)
    out["speedup_each_pair"] = [round(p["s"] / s["s"], 3) for p, s in pairs]
    for phase in ("prefill", "decode"):
        out[f"{phase}_speedup_wall"] = round(out["plain"][f"{phase}_s"]
                                             / max(out["shared"][f"{phase}_s"], 1e-9), 3)
    total = out["plain"]["s"]
    out["plain_split"] = {k: round(out["plain"][f"{k}_s"] / total, 3)
                          for k in ("prefill", "decode", "other")}
    # the most a shared prefill could give: plain's round with its prefill free
    out["bound_prefill_free"] = round(total / (total - out["plain"]["prefill_s"]), 3)
    return out


def bench_rounds(name: str, setting: dict, loaded: dict, pairs: int) -> dict:
    model, tokenizer, task, cfg = loaded[setting["model"]]
    G = setting["generations"]
    prompts, reward = prompts_of(setting, task, tokenizer, setting["prompts"], seed=0)
    S, L = prefix_length(tokenizer, prompts)
    runs, same, diff = {"plain": [], "shared": []}, [], []
    for i in range(pairs + 1):
        order = ("plain", "shared") if i % 2 == 0 else ("shared", "plain")
        found = {}
        for which in order:
            found[which] = one_round(model, tokenizer, task, cfg, prompts, reward, G,
                                     which == "shared", seed=100 + i)
            runs[which].append(found[which])
        same.append(found["plain"]["completions"] == found["shared"]["completions"])
        if same[-1]:
            diff.append(max((a - b).abs().max().item() for a, b in
                            zip(found["plain"]["logp"], found["shared"]["logp"])))
        print(f"  {name} pair {i}: plain {found['plain']['s']:.2f} s, shared "
              f"{found['shared']['s']:.2f} s, same completions {same[-1]}", flush=True)
    return {"setting": f"{setting['prompts']} prompts x G = {G}, prompts of up to {L} tokens, "
                       f"{S} of them shared by every prompt; {cfg.model}, T = {cfg.temperature}, "
                       f"up to {cfg.max_new_tokens or task.max_new_tokens} new tokens; {pairs} "
                       f"interleaved pairs after a warm-up pair, medians",
            "prompts": setting["prompts"], "num_generations": G, "prompt_tokens_max": L,
            "shared_prefix_tokens": S, "same_completions_every_pair": all(same),
            "behaviour_logp_max_diff": max(diff) if diff else None, **summarize(runs)}


def bench_eval(name: str, setting: dict, loaded: dict, count: int, pairs: int) -> dict:
    model, tokenizer, task, cfg = loaded[setting["model"]]
    prompts, reward = prompts_of(setting, task, tokenizer, count, seed=1, eval_set=True)
    S, L = prefix_length(tokenizer, prompts)
    runs, same = {"plain": [], "shared": []}, []
    for i in range(pairs):
        order = ("plain", "shared") if i % 2 == 0 else ("shared", "plain")
        found = {w: one_eval(model, tokenizer, task, cfg, prompts, reward, w == "shared")
                 for w in order}
        for w in order:
            runs[w].append(found[w])
        same.append(found["plain"]["texts"] == found["shared"]["texts"])
        print(f"  {name} eval pair {i}: plain {found['plain']['s']:.2f} s, shared "
              f"{found['shared']['s']:.2f} s, same completions {same[-1]}", flush=True)
    return {"setting": f"greedy_rewards on {count} prompts in one batch, prompts of up to {L} "
                       f"tokens, {S} shared; {pairs} interleaved pairs (the rounds before warmed "
                       f"up), medians",
            "prompts": count, "prompt_tokens_max": L, "shared_prefix_tokens": S,
            "same_completions_every_pair": all(same),
            "accuracy": runs["plain"][0]["accuracy"], **summarize(runs, keep_first=True)}


def load_evidence(wall0: float, cpu0: float, before: tuple) -> dict:
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"load_note": LOAD_NOTE, "cores": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "process_cpu_s": round(cpu, 1), "process_wall_s": round(wall, 1),
            "process_cpu_over_wall": round(cpu / wall, 3)}


def trl_part(steps: int, pairs: int,
             arms=("train_py_shared", "train_py_shared_prefix", "trl_grpo")) -> dict:
    """train.py as it runs by default (the shared prefill), the same with --shared-prefix (issue
    68: the update runs each prompt once too), TRL's GRPOTrainer: fresh processes, interleaved.
    (--trl-arms train_py_plain: train.py with the shared prefill off, as first measured.)"""
    import chunked_logp
    env = chunked_logp.ALLOCATORS["default_allocator"]
    found = {arm: [] for arm in arms}
    plain_patch = ("import rollout; from infra import generation; "
                   "plain = rollout.generate_rollouts; "
                   "rollout.generate_rollouts = lambda *a, **k: plain(*a, **{**k, 'sampler': "
                   "generation.recording_sampler(shared_prefill=False)}); ")     # smollm2 records
    with tempfile.TemporaryDirectory() as folder:
        for i in range(pairs):
            order = list(found) if i % 2 == 0 else list(reversed(found))
            for which in order:
                if which == "trl_grpo":
                    r = chunked_logp.trl_grpo(steps, folder, env)
                else:
                    r = train_py(steps, os.path.join(folder, f"{which}{i}"),
                                 plain_patch if which == "train_py_plain" else "",
                                 ["--shared-prefix"] if which == "train_py_shared_prefix" else [])
                found[which].append(r)
                print(f"  trl pair {i}: {which} {r.get('wall_s_per_step')} s/step "
                      f"(exit {r['exit']})", flush=True)
    med = lambda k, f: round(statistics.median(r[f] for r in found[k]), 3)
    out = {k: {"wall_s_per_step": med(k, "wall_s_per_step"),
               "cpu_s_per_step": med(k, "cpu_s_per_step"), "runs": v} for k, v in found.items()}
    for k in [arm for arm in arms if arm != "trl_grpo" and "trl_grpo" in arms]:
        out[f"{k}_over_trl_wall"] = round(out[k]["wall_s_per_step"]
                                          / out["trl_grpo"]["wall_s_per_step"], 3)
        out[f"{k}_over_trl_cpu"] = round(out[k]["cpu_s_per_step"]
                                         / out["trl_grpo"]["cpu_s_per_step"], 3)
    out["setting"] = (f"{pairs} rounds of {', '.join(arms)}, each a fresh process with one thread, the "
                      f"order reversed every other round; {steps} steps each (16 rollouts of up "
                      f"to 48 tokens, 4 prompts x 4, then one update on them), medians of "
                      f"per-step seconds with the first step left out (chunked_logp.py's "
                      f"train_py and trl_grpo)")
    return out


def train_py(steps: int, out: str, patch: str, extra: list[str] = ()) -> dict:
    """chunked_logp.train_py's command, optionally with the shared prefill turned off (patch) or
    more flags (extra)."""
    import chunked_logp
    w = chunked_logp.SMOLLM2_WORK
    argv = ["--model", "smollm2", "--task", "sums", "--prompts-per-round", str(w["prompts"]),
            "--num-generations", str(w["generations"]), "--buffer-size", "16", "--batch-size",
            "16", "--no-skip-zero-advantage", "--max-new-tokens", str(w["max_new_tokens"]),
            "--lora-r", str(w["lora_r"]), "--lr", str(w["lr"]), "--temperature",
            str(w["temperature"]), "--max-rounds", str(steps), "--eval-prompts", "1",
            "--eval-every", "1000", "--no-plot", "--no-progress", "--seed", "0", "--device",
            "cpu", "--output-dir", out, *extra]
    code, usage = chunked_logp.run_child(
        [sys.executable, "-c", f"import torch; torch.set_num_threads(1); {patch}import train; "
                               f"train.main({argv!r})"], {})
    rows = [] if code else [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = [r for r in rows if "loss" in r]
    before = [None] + rows[:-1]
    spent = lambda r, kind: sum(r[f"{p}_{kind}"] for p in ("gen", "train")) if r else 0.0
    result = {"command": "train.py " + " ".join(argv) + (" (shared_prefill off)" if patch else ""),
              "exit": code, "steps": len(rows), **usage}
    if rows:
        result.update(chunked_logp.per_step(
            [spent(b, "cpu_seconds") - spent(a, "cpu_seconds") for a, b in zip(before, rows)],
            [spent(b, "seconds") - spent(a, "seconds") for a, b in zip(before, rows)]))
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["rounds", "evals"],
                   choices=["rounds", "evals", "trl"])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--pairs", type=int, default=4, help="rounds: pairs after a warm-up pair")
    p.add_argument("--eval-pairs", type=int, default=2)
    p.add_argument("--trl-steps", type=int, default=5)
    p.add_argument("--trl-pairs", type=int, default=2)
    p.add_argument("--trl-arms", nargs="+", choices=["train_py_shared", "train_py_shared_prefix",
                                                     "train_py_plain", "trl_grpo"],
                   default=["train_py_shared", "train_py_shared_prefix", "trl_grpo"])
    p.add_argument("--output", default=OUTPUT)
    p.add_argument("--quiet-cores", action="store_true",
                   help="say in the record that nothing else ran on the cores (the one who ran it "
                        "knows; the load averages kept beside the figures show it too)")
    args = p.parse_args(argv)
    global LOAD_NOTE
    if args.quiet_cores:
        LOAD_NOTE = "cores quiet (nothing else ran)"
    torch.set_num_threads(1)
    import transformers
    results = json.load(open(args.output)) if os.path.exists(args.output) else {}
    results.update({"torch": torch.__version__, "transformers": transformers.__version__,
                    "threads": torch.get_num_threads(), "load_note": LOAD_NOTE})
    loaded = {}
    for name in args.settings if {"rounds", "evals"} & set(args.parts) else []:
        wall0, cpu0, before = time.perf_counter(), time.process_time(), os.getloadavg()
        setting = SETTINGS[name]
        if setting["model"] not in loaded:
            loaded[setting["model"]] = load(setting["model"])
        if "rounds" in args.parts:
            pairs = setting.get("pairs", args.pairs)      # the demo's rounds take ms: more
            results.setdefault("rounds", {})[name] = bench_rounds(name, setting, loaded, pairs)
        if "evals" in args.parts and name in EVALS:
            results.setdefault("evals", {})[name] = bench_eval(name, setting, loaded,
                                                               EVALS[name], args.eval_pairs)
        results.setdefault("load", {})[name] = {
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            **load_evidence(wall0, cpu0, before)}
        write(args.output, results)
    if "trl" in args.parts:
        wall0, cpu0, before = time.perf_counter(), time.process_time(), os.getloadavg()
        results["trl"] = {"measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          **trl_part(args.trl_steps, args.trl_pairs, args.trl_arms),
                          **load_evidence(wall0, cpu0, before)}
        write(args.output, results)
    return results


def write(path: str, results: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"written to {path}", flush=True)


if __name__ == "__main__":
    main()
