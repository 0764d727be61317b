"""Where the time goes in one round of the loop, each part against a bare baseline.

    python benchmarks/bench.py                          # the embedded tiny model on CPU, < 2 minutes
    python benchmarks/bench.py --model Qwen/Qwen2.5-0.5B --dtype bfloat16 --max-new-tokens 128

On the same model and the same batch, side by side (each ratio: the median over --repeats of
ours / bare timed back to back, after --warmup untimed repetitions):
  rollout_overhead = generate_rollouts / bare model.generate of the same prompt ids, with the same
                     sampling settings and the same seed, so both sample the very same tokens
                     (checked: same_tokens); ours also tokenizes, records behaviour log-probs,
                     decodes, scores rewards, computes advantages and builds the Rollouts
  update_overhead  = update_step_engineered / a bare step on the same collated tokens: forward, mean
                     log-prob loss, backward, AdamW step; ours adds collate, the TIS loss and its
                     metrics, gradient clipping
  fast_generation  = plain generate_rollouts / generate_rollouts with --fast-generation (fast_decoding.FastDecoding:
                     a static KV cache kept across calls, the decode step compiled on CUDA): the speed-up,
                     after its first (compiling) call, reported apart as fast_first_call_s; checked:
                     fast_same_tokens (the fraction of completions equal to the plain path's under the
                     same seed: compiled kernels may round differently, so a few may diverge) and
                     fast_logp_max_diff, the largest |stored behaviour log-prob - the training forward's|
                     over the fast path's tokens (float rounding: the stored log-probs are exact)
  buffer_fraction  = (buffer.add + buffer.sample + collate) / one whole round of the loop
and the split of a round (as train.py runs it) between generation and training, with tokens/s.
The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
from transformers import GenerationConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the project's modules

from infra import demo_model  # noqa: E402
import tasks  # noqa: E402
from buffer import ReplayBuffer, collate  # noqa: E402
from infra.distributed import pick_device  # noqa: E402
from replay_rl import completion_logp
from infra.policy import load_policy  # noqa: E402
from infra.engineered_update import update_step_engineered  # noqa: E402
from infra.report import quiet_libraries  # noqa: E402
from infra.fast_decoding import FastDecoding  # noqa: E402
from rollout import end_token_ids, generate_rollouts  # noqa: E402
from infra.generation import recording_sampler       # noqa: E402
from train import Config  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    cfg = Config()      # the loop's own defaults: the benchmark measures the round train.py runs
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="HF model id or local folder; 'tiny' = the embedded demo model")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (cuda if available)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and activations")
    p.add_argument("--prompts", type=int, default=cfg.prompts_per_round, help="prompts per round (default: %(default)s)")
    p.add_argument("--num-generations", type=int, default=cfg.num_generations,
                   help="completions per prompt (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=cfg.batch_size, help="rollouts per update step (default: %(default)s)")
    p.add_argument("--buffer-size", type=int, default=cfg.buffer_size, help="replay buffer capacity (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="longest completion; 0 = the task's own limit")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions; medians are reported (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    p.add_argument("--fast-generation", action="store_true", help="whole rounds (part 3) use the fast path, as "
                   "train.py --fast-generation does")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, sampling and buffer (default: %(default)s)")
    args = p.parse_args(argv)
    if args.batch_size > args.buffer_size:
        p.error(f"--batch-size {args.batch_size}: must be <= --buffer-size {args.buffer_size}")
    return args


def timer(device: str):
    """timed(fn) -> (seconds, fn()). On a GPU it waits for the queued work, so the time covers it."""
    sync = {"cuda": torch.cuda.synchronize, "mps": torch.mps.synchronize}.get(torch.device(device).type, lambda: None)

    def timed(fn):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        return time.perf_counter() - start, out
    return timed


def bare_step(model, optimizer, cols: dict) -> None:
    """The bare baseline of update_step_engineered: forward, mean log-prob loss, backward, optimizer step."""
    mask = cols["completion_mask"]
    C = mask.shape[1]
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=cols["input_ids"], attention_mask=cols["attention_mask"],
                   position_ids=cols["position_ids"], logits_to_keep=C + 1).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, cols["input_ids"][:, -C:, None]).squeeze(-1)
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    optimizer.step()


def side_by_side(timed, ours, bare, repeats: int, warmup: int) -> tuple[float, float, float]:
    """Median seconds of ours() and bare(), and the median of their ratio within each repetition.
    The two run back to back, first one then the other first, so a change of the machine's load
    (other processes, clock boost) hits both alike; the paired ratio is the robust figure."""
    times = {ours: [], bare: []}
    for i in range(warmup + repeats):
        for fn in (ours, bare) if i % 2 == 0 else (bare, ours):
            seconds, _ = timed(fn)
            if i >= warmup:
                times[fn].append(seconds)
    ratios = [a / b for a, b in zip(times[ours], times[bare])]
    return statistics.median(times[ours]), statistics.median(times[bare]), statistics.median(ratios)


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet_libraries()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Config()
    device = pick_device(args.device)
    timed = timer(device)
    task = tasks.load_task(cfg.task)
    model_path = demo_model.tiny_model(task) if args.model == "tiny" else args.model
    model, tokenizer = load_policy(model_path, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, device=device,
                                   dtype=DTYPES[args.dtype])
    params = [p for p in model.parameters() if p.requires_grad]
    new_optimizer = lambda: torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)  # as train.py
    rng = random.Random(args.seed)
    max_new_tokens = args.max_new_tokens or task.max_new_tokens
    G, pad_id, eos_id = args.num_generations, tokenizer.pad_token_id, tokenizer.eos_token_id
    eos_ids = end_token_ids(model, tokenizer)[0]        # the ids that end a completion (collate's)
    # The loop's own settings (train.py's defaults), shared by every call below.
    sampling = dict(num_generations=G, max_new_tokens=max_new_tokens, temperature=cfg.temperature)
    # as train.py --record-log-mu samples (log mu recorded, each prompt prefilled once)
    step = dict(pad_id=pad_id, eos_ids=eos_ids, loss_type=cfg.loss, is_cap=cfg.is_cap, epsilon=cfg.epsilon,
                normalization=cfg.normalization, temperature=cfg.temperature,
                micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm)

    # ---- 1. rollouts vs bare generate: same prompt ids, same sampling settings, same seed -------
    prompts = rng.sample(task.train_prompts, args.prompts)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=False).to(device)
    gen_config = GenerationConfig(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id)
    input_ids, attention_mask = enc.input_ids.repeat_interleave(G, 0), enc.attention_mask.repeat_interleave(G, 0)

    def rollout():
        torch.manual_seed(args.seed)
        return generate_rollouts(model, tokenizer, prompts, task.reward, policy_version=0,
                                 sampler=recording_sampler(), **sampling)

    def bare_generate():
        torch.manual_seed(args.seed)
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_config)

    model.eval()
    rollouts, _ = rollout()
    new = bare_generate()[:, input_ids.shape[1]:].cpu()
    # Equal work: the bare run generated the same number of steps and the very same tokens.
    same_tokens = new.shape[1] == max(len(r.completion_ids) for r in rollouts) and all(
        torch.equal(new[i, :len(r.completion_ids)], r.completion_ids) for i, r in enumerate(rollouts))
    rollout_s, generate_s, rollout_overhead = side_by_side(timed, rollout, bare_generate, args.repeats, args.warmup)

    # ---- 1b. the fast path (--fast-generation) vs plain, same prompts and seed -------------------
    fast = FastDecoding(model)

    def fast_rollout():
        torch.manual_seed(args.seed)
        return generate_rollouts(model, tokenizer, prompts, task.reward, policy_version=0,
                                 sampler=recording_sampler(fast=fast), **sampling)

    fast_first_s, (fast_rollouts, _) = timed(fast_rollout)         # compiles (on CUDA): minutes at worst
    fast_same = statistics.mean(float(torch.equal(a.completion_ids, b.completion_ids))
                                for a, b in zip(rollouts, fast_rollouts))
    cols = collate(fast_rollouts, pad_id, device=device, eos_ids=eos_ids)
    with torch.no_grad():
        logp, _ = completion_logp(model, cols, cfg.temperature)
    fast_logp_diff = ((logp - cols["behaviour_logp"]).abs() * cols["completion_mask"]).max().item()
    fast_s, plain_s, fast_ratio = side_by_side(timed, fast_rollout, rollout, args.repeats, args.warmup)

    # ---- 2. update step vs bare step on the same batch -----------------------------------------
    buffer = ReplayBuffer(args.buffer_size, seed=args.seed)
    buffer.add(rollouts)
    while len(buffer) < args.batch_size:        # more rounds until the buffer can give a batch
        buffer.add(generate_rollouts(model, tokenizer, rng.sample(task.train_prompts, args.prompts), task.reward,
                                     policy_version=0, sampler=recording_sampler(), **sampling)[0])
    model.train()
    batch = buffer.sample(args.batch_size)
    cols = collate(batch, pad_id, device=device, eos_ids=eos_ids)
    optimizer, bare_optimizer = new_optimizer(), new_optimizer()

    def update():
        return update_step_engineered(model, optimizer, batch, current_version=0, **step)

    def bare_update():
        bare_step(model, bare_optimizer, cols)

    update_s, bare_update_s, update_overhead = side_by_side(timed, update, bare_update, args.repeats, args.warmup)

    # ---- 3. whole rounds, as train.py runs them: rollouts -> buffer -> one update ----------------
    parts = {k: [] for k in ("generation", "add", "sample", "collate", "update", "total")}
    gen_tokens, train_tokens = [], []
    for i in range(args.warmup + args.repeats):
        prompts = rng.sample(task.train_prompts, args.prompts)
        model.eval()
        t_gen, (rollouts, stats) = timed(
            lambda: generate_rollouts(model, tokenizer, prompts, task.reward, policy_version=i,
                                      sampler=recording_sampler(
                                          fast=fast if args.fast_generation else None),
                                      **sampling))
        model.train()
        t_add, _ = timed(lambda: buffer.add(rollouts))
        t_sample, batch = timed(lambda: buffer.sample(args.batch_size))
        t_collate, _ = timed(lambda: collate(batch, pad_id, i, eos_ids=eos_ids))     # apart: update_step_engineered collates inside
        t_update, _ = timed(lambda: update_step_engineered(model, optimizer, batch, current_version=i, **step))
        if i >= args.warmup:
            for k, t in zip(parts, (t_gen, t_add, t_sample, t_collate, t_update, t_gen + t_add + t_sample + t_update)):
                parts[k].append(t)
            gen_tokens.append(stats["new_tokens"])
            train_tokens.append(sum(len(r.completion_ids) for r in batch))
    ms = {k: 1000 * statistics.median(v) for k, v in parts.items()}
    buffer_ms = ms["add"] + ms["sample"] + ms["collate"]

    result = {
        "rollout_overhead": rollout_overhead,
        "fast_generation": 1 / fast_ratio, "fast_same_tokens": fast_same, "fast_logp_max_diff": fast_logp_diff,
        "fast_first_call_s": fast_first_s, "fast_rollout_ms": 1000 * fast_s, "plain_rollout_ms": 1000 * plain_s,
        "update_overhead": update_overhead,
        "buffer_fraction": buffer_ms / ms["total"],
        "generation_fraction": ms["generation"] / ms["total"],
        "training_fraction": ms["update"] / ms["total"],
        "gen_tokens_per_s": statistics.median(gen_tokens) / ms["generation"] * 1000,
        "train_tokens_per_s": statistics.median(train_tokens) / ms["update"] * 1000,
        "rollout_ms": 1000 * rollout_s, "generate_ms": 1000 * generate_s,
        "update_ms": 1000 * update_s, "bare_update_ms": 1000 * bare_update_s,
        **{f"round_{k}_ms": v for k, v in ms.items()},
        "same_tokens": same_tokens,
        "fast_rounds": args.fast_generation, "model": args.model, "device": device, "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "rollouts_per_round": args.prompts * G, "batch_size": args.batch_size, "buffer_size": args.buffer_size,
        "repeats": args.repeats, "torch": torch.__version__,
    }
    print_table(result, ms, args)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    return result


def print_table(r: dict, ms: dict, args) -> None:
    print(f"\nmodel {r['model']} on {r['device']} ({r['dtype']}, {r['threads']} threads, torch {r['torch']}); "
          f"round: {args.prompts} prompts x {args.num_generations} = {r['rollouts_per_round']} rollouts, "
          f"batch {args.batch_size}, buffer {args.buffer_size}; median of {args.repeats} after {args.warmup} warm-up")
    print(f"\n{'side by side, same batch':<44}{'ours ms':>9}{'bare ms':>9}{'ratio':>8}")
    print(f"{'generate_rollouts vs model.generate':<44}{r['rollout_ms']:>9.1f}{r['generate_ms']:>9.1f}"
          f"{r['rollout_overhead']:>8.3f}" + ("" if r["same_tokens"] else "   (different tokens!)"))
    print(f"{'generate_rollouts: fast path vs plain':<44}{r['fast_rollout_ms']:>9.1f}{r['plain_rollout_ms']:>9.1f}"
          f"{1 / r['fast_generation']:>8.3f}   ({r['fast_generation']:.2f}x faster; same tokens "
          f"{r['fast_same_tokens']:.0%}, |log-prob error| <= {r['fast_logp_max_diff']:.1e}; first call "
          f"{r['fast_first_call_s']:.1f} s)")
    print(f"{'update_step_engineered vs bare fwd+loss+bwd+AdamW':<44}{r['update_ms']:>9.1f}{r['bare_update_ms']:>9.1f}"
          f"{r['update_overhead']:>8.3f}")
    print("(ms: medians; ratio: median of the per-repetition ratios ours / bare)")
    print(f"\n{'one round of the loop':<44}{'ms':>9}{'share':>9}{'tokens/s':>10}")
    rows = [("generation (generate_rollouts)", ms["generation"], f"{r['gen_tokens_per_s']:>10.0f}"),
            ("training (update_step_engineered)", ms["update"], f"{r['train_tokens_per_s']:>10.0f}"),
            ("buffer.add", ms["add"], ""), ("buffer.sample", ms["sample"], ""),
            ("collate (measured apart, also in update)", ms["collate"], ""),
            ("buffer: add + sample + collate", ms["add"] + ms["sample"] + ms["collate"], ""),
            ("whole round", ms["total"], "")]
    for name, t, extra in rows:
        print(f"{name:<44}{t:>9.2f}{t / ms['total']:>9.1%}{extra}")
    print("(tokens = completion tokens, EOS included: sampled per second / trained on per second)\n")


if __name__ == "__main__":
    main()
