"""How much of a SmolLM2 round's decode is the model's arithmetic, and how much is ``generate``'s
per-token overhead (issue 68, item 3)? One round of rollout.generate_rollouts at train.py
--model smollm2's settings (4 sums prompts x G = 4 in the chat template, T = 0.7, 48 new tokens,
each prompt prefilled once), one thread, under torch.profiler. Writes docs/results/decode_cpu.json.

    python benchmarks/decode_overhead.py              # ~1 min on a quiet core
    python benchmarks/decode_overhead.py --rounds 1   # a smoke test

The profiled round's seconds are split three ways, from the profiler's self time of each op:
  matmul      the dense kernels (mm, addmm, bmm, the attention kernel): the model's arithmetic,
              which a static cache or a compiled step would not remove
  other_ops   every other aten op (elementwise, norms, cat into the cache, indexing, sampling)
  outside     time in no aten op: Python, transformers' per-layer and per-token code, the
              dispatcher, and the profiler's own per-op cost (the profiled round's seconds minus
              the ops' self time); the same round without the profiler is timed beside it
The overhead a static-cache, compiled decode could remove is at most what is not matmul: 1 minus
the matmul kernels' seconds over the round's seconds without the profiler (an upper bound: norms
and activations stay, fused). The profiler's times are wall-clock: run it on quiet cores
(cpu_over_wall near 1 says they were).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tasks                                    # noqa: E402
from infra import pretrained, runfolder        # noqa: E402
from infra.policy import load_policy            # noqa: E402
from rollout import generate_rollouts                         # noqa: E402
from infra.generation import recording_sampler               # noqa: E402

P, G, T, NEW_TOKENS = 4, 4, 0.7, 48
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm",
          "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::_scaled_dot_product_attention_math", "aten::baddbmm")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "decode_cpu.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    problem = pretrained.gguf_problem("smollm2")
    if problem:
        sys.exit(f"error: {problem}")
    folder = pretrained.resolve("smollm2", log=lambda line: None)
    task = tasks.sums_task()
    torch.manual_seed(0)
    model, tokenizer = load_policy(folder, lora_r=8)
    model.eval()
    rounds = []
    for round_ in range(args.rounds + 1):                       # round 0: a warm-up, not kept
        questions = task.train_prompts[round_ * P:(round_ + 1) * P]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in questions]
        def one_round():
            torch.manual_seed(round_)
            return generate_rollouts(model, tokenizer, prompts, lambda q, c: 0.0,
                                     num_generations=G, max_new_tokens=NEW_TOKENS,
                                     temperature=T, policy_version=0,
                                     sampler=recording_sampler())[1]
        # the round's seconds without the profiler (it adds its own per-op cost), then the same
        # round (same seed, same tokens) under it for the split
        cpu0, wall0 = time.process_time(), time.perf_counter()
        stats = one_round()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            assert one_round()["completions"] == stats["completions"]
        profiled = time.perf_counter() - start
        events = prof.key_averages()
        self_s = {e.key: e.self_cpu_time_total / 1e6 for e in events}
        matmul = sum(s for k, s in self_s.items() if k in MATMUL)
        ops = sum(s for k, s in self_s.items() if k.startswith("aten::"))
        if round_:
            rounds.append({"cpu_s": cpu, "wall_s": wall, "profiled_s": profiled,
                           "matmul_s": matmul, "other_ops_s": ops - matmul,
                           "outside_s": max(profiled - ops, 0.0),
                           "new_tokens": stats["new_tokens"]})
            r = rounds[-1]
            print(f"round {round_}: {wall:.2f} s ({cpu:.2f} CPU s), profiled {profiled:.2f} s: "
                  f"matmul {matmul:.2f}, other ops {ops - matmul:.2f}, outside ops "
                  f"{r['outside_s']:.2f}", flush=True)
    total = sum(r["profiled_s"] for r in rounds)
    share = {part: round(sum(r[f"{part}_s"] for r in rounds) / total, 3)
             for part in ("matmul", "other_ops", "outside")}
    # the matmul kernels over the round without the profiler: the rest, 1 minus it, is what a
    # compiled decode could at most remove, the profiler's own cost left out
    matmul_unprofiled = round(sum(r["matmul_s"] for r in rounds)
                              / sum(r["wall_s"] for r in rounds), 3)
    result = {"share_is_of": "the profiled round's wall seconds",
              "settings": {"model": "smollm2", "prompts": P, "G": G, "temperature": T,
                           "max_new_tokens": NEW_TOKENS, "threads": 1, "shared_prefill": True,
                           "torch": torch.__version__, "rounds": args.rounds},
              "rounds": rounds, "share_of_profiled_round": share,
              "matmul_share_of_unprofiled_round": matmul_unprofiled,
              "removable_upper_bound": round(1 - matmul_unprofiled, 3),
              "cpu_over_wall": round(sum(r["cpu_s"] for r in rounds)
                                     / sum(r["wall_s"] for r in rounds), 3),
              "profiler_cost": round(total / sum(r["wall_s"] for r in rounds), 3),
              "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    runfolder.write_json(args.out, result, indent=1)        # whole or not at all
    return result


if __name__ == "__main__":
    main()
