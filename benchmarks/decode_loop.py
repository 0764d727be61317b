"""generate's own per-token cost on this CPU (issue 68, item 3): the decode of a SmolLM2 round by
``generate`` against a bare loop that does only the model's work, side by side in one process.

    python benchmarks/decode_loop.py               # ~2 min on a quiet core, one thread
    python benchmarks/decode_loop.py --rounds 1    # a smoke test

Both start from the same prompt cache (generation.prefill_once: train.py --model smollm2's 4 sums
prompts x G = 4 in the chat template, each prompt prefilled once) and run the same number of decode
steps (those generate ran, 48 at most):

  generate  model.generate with generate_completions' plain-sampling config and the log mu recorder,
            as train.py samples (its logits processors, stopping criteria, cache bookkeeping)
  bare      per step: the model's forward on the last token with the cache, log_softmax(z / T),
            torch.multinomial, log mu gathered; nothing else

generate's overhead is 1 - bare / generate, of the decode's seconds (the prefill left out of both).
A static-cache, compiled decode could remove at most that overhead plus what fusing the model's own
small ops saves (decode_overhead.py's bound: everything but the matmul kernels). Arms alternate,
their order reversed every round; CPU seconds of the process, medians over the rounds after a
warm-up round. Writes docs/results/decode_loop_cpu.json.
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

import tasks                                    # noqa: E402
from infra import pretrained, runfolder        # noqa: E402
from infra.policy import load_policy            # noqa: E402
from infra.generation import BehaviourLogProbs, prefill_once  # noqa: E402
from rollout import PLAIN_SAMPLING, end_token_ids  # noqa: E402
from transformers import GenerationConfig, LogitsProcessorList  # noqa: E402

P, G, T, NEW_TOKENS = 4, 4, 0.7, 48


def prompt_cache(model, tokenizer, prompts):
    enc = [torch.tensor(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    _, pad_id = end_token_ids(model, tokenizer)
    return prefill_once(model, enc, pad_id, G)


@torch.inference_mode()
def by_generate(model, tokenizer, prompts, seed: int, steps: int | None = None):
    """(seconds of the decode, its steps): generate from the prefilled cache, as train.py."""
    eos_ids, pad_id = end_token_ids(model, tokenizer)
    ids, mask, extra = prompt_cache(model, tokenizer, prompts)
    config = GenerationConfig(**PLAIN_SAMPLING, temperature=T, max_new_tokens=steps or NEW_TOKENS,
                              eos_token_id=None if steps else eos_ids, pad_token_id=pad_id)
    recorder = BehaviourLogProbs(model, config)
    torch.manual_seed(seed)
    start = time.process_time()
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                         logits_processor=LogitsProcessorList([recorder]), **extra)
    seconds = time.process_time() - start
    recorder.finish(out[:, ids.shape[1]:])
    return seconds, out.shape[1] - ids.shape[1]


@torch.inference_mode()
def by_hand(model, tokenizer, prompts, seed: int, steps: int):
    """Seconds of ``steps`` decode steps from the same cache, the model's work alone."""
    ids, mask, extra = prompt_cache(model, tokenizer, prompts)
    keyword, cache = next(iter(extra.items()))
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    token, at = ids[:, -1:], position[:, -1:]
    torch.manual_seed(seed)
    start = time.process_time()
    logps = []
    for _ in range(steps):
        logits = model(input_ids=token, attention_mask=mask, position_ids=at, use_cache=True,
                       **{keyword: cache}).logits[:, -1].float()
        logp = torch.log_softmax(logits / T, -1)
        token = torch.multinomial(logp.exp(), 1)
        logps.append(logp.gather(-1, token))
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        at = at + 1
    return time.process_time() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "decode_loop_cpu.json"))
    p.add_argument("--note", default="", help="what else ran on the cores (kept in the record)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    problem = pretrained.gguf_problem("smollm2")
    if problem:
        sys.exit(f"error: {problem}")
    torch.manual_seed(0)
    model, tokenizer = load_policy(pretrained.resolve("smollm2", log=lambda line: None), lora_r=8)
    model.eval()
    task = tasks.sums_task()
    rounds = []
    for round_ in range(args.rounds + 1):                       # round 0: a warm-up, not kept
        questions = task.train_prompts[round_ * P:(round_ + 1) * P]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in questions]
        _, steps = by_generate(model, tokenizer, prompts, round_)     # how many steps it runs
        arms = {"generate": lambda: by_generate(model, tokenizer, prompts, round_, steps)[0],
                "bare": lambda: by_hand(model, tokenizer, prompts, round_, steps)}
        order = list(arms) if round_ % 2 == 0 else list(arms)[::-1]
        seconds = {arm: arms[arm]() for arm in order}
        print(f"round {round_}{' (warm-up)' if not round_ else ''}: {steps} steps, generate "
              f"{seconds['generate']:.2f} CPU s, bare {seconds['bare']:.2f}", flush=True)
        if round_:
            rounds.append({"steps": steps, **{f"{arm}_cpu_s": s for arm, s in seconds.items()}})
    median = {arm: statistics.median(r[f"{arm}_cpu_s"] for r in rounds)
              for arm in ("generate", "bare")}
    result = {"settings": {"model": "smollm2", "prompts": P, "G": G, "temperature": T,
                           "max_new_tokens": NEW_TOKENS, "threads": 1, "shared_prefill": True,
                           "torch": torch.__version__, "rounds": args.rounds},
              "rounds": rounds, "median_cpu_s": {k: round(v, 3) for k, v in median.items()},
              "generate_overhead": round(1 - median["bare"] / median["generate"], 3),
              "overhead_each_round": [round(1 - r["bare_cpu_s"] / r["generate_cpu_s"], 3)
                                      for r in rounds],
              "note": args.note, "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    runfolder.write_json(args.out, result, indent=1)        # whole or not at all
    return result


if __name__ == "__main__":
    main()
