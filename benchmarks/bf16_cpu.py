"""bfloat16 on a CPU with native bfloat16 units (AVX512_BF16), against float32: is the importance
ratio still honest, and what does it save? SmolLM2-135M at train.py --model smollm2's settings
(4 sums prompts x G = 4 in the chat template, T = 0.7, 48 new tokens, LoRA r 8), one thread.
Writes docs/results/bf16_cpu.json.

    python benchmarks/bf16_cpu.py                 # ~5 min on a quiet core
    python benchmarks/bf16_cpu.py --rounds 1      # a smoke test

  ratios   on fresh data, rho_t = pi_theta(o_t) / mu(o_t) must be 1: mu recorded while generate
           sampled (the KV-cache decode), pi_theta from the training forward (one pass over the
           whole sequence), the same weights. Per dtype, over ``rounds`` rounds of rollouts:
           |log rho_t| mean and max, rho's min and max. The bar (issue 68): within 1e-3 of 1.
  seconds  per dtype, interleaved (float32, bfloat16; then bfloat16, float32; ...): a round of
           generate_rollouts and one update step (replay_rl.update_step, AdamW at lr 0 so that
           the weights stay put) on its 16 rollouts; the bfloat16 / float32 ratio of the medians.
Load: the process's CPU seconds over wall seconds and os.getloadavg() before and after are kept:
on a loaded machine the ratios are the figure to read, not the times.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tasks                                            # noqa: E402
from buffer import collate                              # noqa: E402
from infra import pretrained, runfolder                # noqa: E402
from infra.policy import load_policy                    # noqa: E402
from replay_rl import completion_logp, update_step      # noqa: E402
from rollout import end_token_ids, generate_rollouts    # noqa: E402
from infra.generation import recording_sampler         # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
P, G, T, NEW_TOKENS = 4, 4, 0.7, 48
BAR = 1e-3


def prompts_of(tokenizer, task, round_: int) -> list[str]:
    questions = task.train_prompts[round_ * P:(round_ + 1) * P]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in questions]


def one_round(model, tokenizer, task, round_: int, optimizer) -> dict:
    """Rollouts of one round, their fresh log rho, and the seconds of the round and of a step."""
    torch.manual_seed(round_)
    model.eval()
    prompts = prompts_of(tokenizer, task, round_)
    questions = dict(zip(prompts, task.train_prompts[round_ * P:(round_ + 1) * P]))
    start = time.perf_counter()
    rollouts, _ = generate_rollouts(model, tokenizer, prompts,
                                    lambda p, c: task.reward(questions[p], c),
                                    num_generations=G, max_new_tokens=NEW_TOKENS, temperature=T,
                                    policy_version=0, sampler=recording_sampler())
    generation = time.perf_counter() - start
    eos_ids, pad_id = end_token_ids(model, tokenizer)
    cols = collate(rollouts, pad_id, 0, eos_ids=eos_ids)
    with torch.no_grad():
        logp, _ = completion_logp(model, cols, T)
    real = cols["completion_mask"] > 0
    log_rho = (logp - cols["behaviour_logp"])[real].double()
    start = time.perf_counter()
    update_step(model, optimizer, rollouts, pad_id=pad_id, eos_ids=eos_ids, current_version=0,
                temperature=T)
    step = time.perf_counter() - start
    return {"tokens": int(real.sum()), "abs_log_rho": log_rho.abs().tolist(),
            "generation_s": generation, "step_s": step}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "bf16_cpu.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    problem = pretrained.gguf_problem("smollm2")
    if problem:
        sys.exit(f"error: {problem}")
    folder = pretrained.resolve("smollm2", log=lambda line: None)
    task = tasks.sums_task()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    models = {}
    for name, dtype in DTYPES.items():
        torch.manual_seed(0)
        model, tokenizer = load_policy(folder, lora_r=8, dtype=dtype)
        optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=0.0)
        models[name] = (model, tokenizer, optimizer)
    per = {name: [] for name in DTYPES}
    wall0, cpu0, before = time.perf_counter(), time.process_time(), os.getloadavg()
    for round_ in range(args.rounds):
        order = list(DTYPES) if round_ % 2 == 0 else list(reversed(DTYPES))
        for name in order:
            model, tokenizer, optimizer = models[name]
            per[name].append(one_round(model, tokenizer, task, round_, optimizer))
            r = per[name][-1]
            print(f"round {round_} {name}: {r['tokens']} tokens, "
                  f"generation {r['generation_s']:.1f} s,"
                  f" step {r['step_s']:.1f} s, |log rho| max {max(r['abs_log_rho']):.2e}",
                  flush=True)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    result = {"settings": {"model": "smollm2", "prompts": P, "G": G, "temperature": T,
                           "max_new_tokens": NEW_TOKENS, "rounds": args.rounds, "threads": 1,
                           "torch": torch.__version__,
                           "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags},
              "load": {"cpu_over_wall": round(cpu / wall, 3),
                       "loadavg_before": [round(x, 2) for x in before],
                       "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
              "bar_abs_log_rho": BAR}
    for name, rounds in per.items():
        abs_log_rho = [x for r in rounds for x in r["abs_log_rho"]]
        result[name] = {
            "tokens": sum(r["tokens"] for r in rounds),
            "abs_log_rho_mean": statistics.fmean(abs_log_rho),
            "abs_log_rho_max": max(abs_log_rho),
            "within_bar": max(abs_log_rho) <= BAR,
            "generation_s": [round(r["generation_s"], 3) for r in rounds],
            "step_s": [round(r["step_s"], 3) for r in rounds]}
    for part in ("generation_s", "step_s"):
        result[f"bfloat16_over_float32_{part}"] = round(
            statistics.median(result["bfloat16"][part])
            / statistics.median(result["float32"][part]), 3)
    print(json.dumps({k: v for k, v in result.items() if k not in DTYPES}, indent=1))
    for name in DTYPES:
        r = result[name]
        print(f"{name}: |log rho| mean {r['abs_log_rho_mean']:.2e} max {r['abs_log_rho_max']:.2e} "
              f"over {r['tokens']} tokens: {'within' if r['within_bar'] else 'NOT within'} {BAR:g}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    runfolder.write_json(args.out, result, indent=1)        # whole or not at all
    return result


if __name__ == "__main__":
    main()
