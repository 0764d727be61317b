"""What a round costs on this machine: the seconds of one round's generation against its size R, and of
one optimizer step against its batch B. compare.py projects each arm's time to the target on this curve.

    python comparison/cost.py --output cost.json        # the demo (tiny model, addition) on CPU, < 5 minutes
    python comparison/compare.py --summary docs/results/tuned.json --cost cost.json    # which arm is first here?
    # a GPU: a model with Qwen2.5-0.5B's shapes and random weights, and prompts of ~231 tokens (GSM8K's),
    # both built by gpu_check.sh; completions forced to the length limit
    GPU_CHECK_BUILD_ONLY=1 GPU_CHECK_ROWS= GPU_CHECK_DIR=/tmp/g bash benchmarks/gpu_check.sh
    python comparison/cost.py --model /tmp/g/model --task /tmp/g/gsm8k_231.jsonl --max-new-tokens 256 \\
        --force-length --threads 0 --output cost_gpu.json

What it times is what train.py runs: rollout.generate_rollouts on R = P x G rollouts (P prompts of the
task, G samples each, at the loop's temperature), the model loaded as train.py loads it (loading.load_model:
dtype, LoRA, chat template); and engineered_update.update_step_engineered on B of those rollouts with train.py's defaults
(loss, cap, normalization, --micro-batch-size). Each point: the median of --repeats calls after one
untimed warm-up call at that size (with the fast path, the warm-up compiles: its seconds are kept
apart, first_call_s). Generation runs first at every size (plain, then --fast-generation where it
applies: a CUDA GPU, not 4-bit), then training, whose steps change the weights. Completions: sampled
as in a run (their lengths are the model's; each point records its mean completion tokens), or with
--force-length every completion runs to the limit (the end tokens' logits pushed to -1e4 while
generating: a GPU's cost at the limit, independent of what random weights happen to emit).
A size that does not fit in memory ends its series (recorded); --time-limit stops starting new points.

Conditions: compare.py runs every arm in a process of one torch thread (OMP_NUM_THREADS=1), two arms
side by side (--jobs 2). By default this runs one thread (--threads 1; 0 = torch's default) and alone;
--side-by-side runs a second copy of the same measurement at the same time, as compare.py's second
arm would be. The file says which ("conditions"), with the device, dtype, threads and versions.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]     # the project's modules; bench.py's timer

from infra import cli  # noqa: E402
from infra import distributed  # noqa: E402
from infra.generation import recording_sampler  # noqa: E402
from infra import loading  # noqa: E402
import rollout  # noqa: E402
from bench import timer  # noqa: E402  (benchmarks/bench.py)
from infra.engineered_update import update_step_engineered  # noqa: E402
from infra.report import quiet_libraries  # noqa: E402
from train import Config  # noqa: E402

SIZES = (16, 32, 64, 128, 256, 512)


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.OneLineParser(prog="cost.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="HF model id or local folder; 'tiny' = the embedded demo model")
    p.add_argument("--task", default="addition", help="the task whose prompts are used (their length matters)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="longest completion; 0 = the task's own limit")
    p.add_argument("--num-generations", type=int, default=8, help="G: R = prompts x G (default: %(default)s)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                   help="R of the generation points and B of the training points (multiples of G)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per point; medians (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads, as compare.py's runs (1); 0 = torch's "
                                                          "default")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="base weights, as train.py's --dtype")
    p.add_argument("--load-in-4bit", action="store_true", help="as train.py's")
    p.add_argument("--gradient-checkpointing", action="store_true", help="as train.py's")
    p.add_argument("--micro-batch-size", type=int, default=0, help="as train.py's (0 = B)")
    p.add_argument("--fast-generation", default="auto", choices=("auto", "on", "off"),
                   help="also time generation with train.py's --fast-generation: auto = where it applies (CUDA, "
                        "not 4-bit), on = also elsewhere, off = never")
    p.add_argument("--force-length", action="store_true", help="every completion runs to --max-new-tokens")
    p.add_argument("--side-by-side", action="store_true",
                   help="run a second copy of this measurement at the same time, as compare.py runs two arms")
    p.add_argument("--time-limit", type=float, default=0, help="start no new point after this many seconds; 0 = none")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (the lengths of the "
                   "completions follow it); 0 = train.py's default for --model")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and sampling")
    p.add_argument("--output", default="cost.json", help="the JSON curve")
    args = p.parse_args(argv)
    bad = [s for s in args.sizes if s < 1 or s % args.num_generations]
    if bad or args.repeats < 1:
        p.error(f"--sizes {bad}: each must be a positive multiple of --num-generations {args.num_generations}"
                if bad else "--repeats must be >= 1")
    return args


def suppress_end_tokens(model, tokenizer):
    """--force-length: the end tokens' logits set to -1e4 in every forward (a hook on the output layer),
    so no completion ends before the limit. Returns the hook's handle (.remove() it)."""
    ends = torch.tensor(rollout.end_token_ids(model, tokenizer)[0])

    def hook(module, inputs, logits):
        return logits.index_fill(-1, ends.to(logits.device), -1e4)
    return model.get_output_embeddings().register_forward_hook(hook)


def measure(args, timed, fn, size: int, key: str, first_call: bool = False) -> dict:
    """One point: an untimed warm-up call of fn(), then the median seconds of --repeats calls, and the
    mean completion tokens of what the calls worked on (fn returns it)."""
    first_s, _ = timed(fn)
    runs = [timed(fn) for _ in range(args.repeats)]
    point = {key: size, "seconds": statistics.median(s for s, _ in runs), "runs": [s for s, _ in runs],
             "mean_completion_tokens": statistics.fmean(t for _, t in runs)}
    return {**point, "first_call_s": first_s} if first_call else point


def series(args, sizes, key: str, point_of, started: float) -> list[dict]:
    """Points at each size until one does not fit in memory (larger ones would not either) or the time
    limit has passed."""
    points = []
    for size in sizes:
        if args.time_limit and time.time() - started > args.time_limit:
            points.append({key: size, "skipped": f"--time-limit {args.time_limit:g} s"})
            continue
        try:
            points.append(point_of(size))
        except torch.OutOfMemoryError:
            points.append({key: size, "error": "out of memory"})
            torch.cuda.empty_cache()
            break
        print(f"  {key} = {size}: {points[-1]['seconds']:.4f} s", flush=True)
    return points


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.time()
    partner = None
    if args.side_by_side:           # the same measurement in a second process, at the same time
        handle, partner_file = tempfile.mkstemp(suffix=".json")
        os.close(handle)
        argv_partner = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--side-by-side"]
        env = {**os.environ, **({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} if args.threads == 1 else {})}
        partner = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv_partner, "--output", partner_file],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    quiet_libraries()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Config(model=args.model, task=args.task, dtype=args.dtype, load_in_4bit=args.load_in_4bit,
                 gradient_checkpointing=args.gradient_checkpointing, micro_batch_size=args.micro_batch_size,
                 num_generations=args.num_generations, max_new_tokens=args.max_new_tokens, seed=args.seed,
                 temperature=args.temperature or cli.MODEL_DEFAULTS.get(args.model, {}).get("temperature", 1.0),
                 progress=False)
    device = distributed.pick_device(args.device)
    task = loading.load_task(cfg, training=False)
    model, tokenizer, task = loading.load_model(cfg, task, device, rank=0)
    timed = timer(device)
    G, max_new = args.num_generations, args.max_new_tokens or task.max_new_tokens
    rng = random.Random(args.seed)
    sizes = sorted(set(args.sizes))
    fast_applies = device.startswith("cuda") and not args.load_in_4bit
    modes = ["plain"] + (["fast"] if args.fast_generation == "on" or (args.fast_generation == "auto" and fast_applies)
                         else [])
    fast = loading.fast_decoding(cfg, model, tokenizer, task, device) if "fast" in modes else None
    pool = []                       # rollouts of the largest round: the batches of the training points

    def generate(R: int, mode: str):
        prompts = rng.sample(task.train_prompts, R // G) if R // G <= len(task.train_prompts) else \
            rng.choices(task.train_prompts, k=R // G)
        rollouts, stats = rollout.generate_rollouts(
            model, tokenizer, prompts, task.reward, num_generations=G, max_new_tokens=max_new,
            temperature=cfg.temperature, policy_version=0,
            sampler=recording_sampler(fast=fast if mode == "fast" else None))
        if len(rollouts) >= len(pool):
            pool[:] = rollouts
        return stats["new_tokens"] / R

    hook = suppress_end_tokens(model, tokenizer) if args.force_length else None
    model.eval()
    generation = {}
    for mode in modes:
        print(f"generation ({mode}):", flush=True)
        generation[mode] = series(args, sizes, "R", lambda R: measure(args, timed, lambda: generate(R, mode), R, "R",
                                                                      first_call=mode == "fast"), started)
    while pool and len(pool) < max(sizes):      # the largest round did not fit: more rounds of the largest that did
        more = pool[:]
        generate(len(more), "plain")
        pool[:] = more + pool
    if hook is not None:
        hook.remove()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.99),
                                  weight_decay=0.0)                          # as train.py's

    eos_ids, pad_id = rollout.end_token_ids(model, tokenizer)

    def step(B: int):
        batch = rng.sample(pool, B)
        update_step_engineered(model, optimizer, batch, pad_id=pad_id, eos_ids=eos_ids, current_version=0, loss_type=cfg.loss,
                    is_cap=cfg.is_cap, epsilon=cfg.epsilon, normalization=cfg.normalization,
                    temperature=cfg.temperature, asymre_tau=cfg.asymre_tau, micro_batch_size=cfg.micro_batch_size,
                    max_grad_norm=cfg.max_grad_norm)
        return statistics.fmean(len(r.completion_ids) for r in batch)
    print("training:", flush=True)
    training = series(args, [s for s in sizes if s <= len(pool)], "B", lambda B: measure(args, timed, lambda: step(B),
                                                                                          B, "B"), started)

    import peft
    import transformers
    prompt_tokens = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in task.train_prompts[:200]]
    result = {
        "device": device + (f" ({torch.cuda.get_device_name(0)})" if device.startswith("cuda") else ""),
        "dtype": str(loading.pick_dtype(args.dtype, device)).replace("torch.", "") + (", 4-bit" if args.load_in_4bit else ""),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "model": args.model, "task": args.task,
        "prompt_tokens_mean": statistics.fmean(prompt_tokens), "max_new_tokens": max_new, "num_generations": G,
        "temperature": cfg.temperature,
        "force_length": args.force_length, "micro_batch_size": args.micro_batch_size,
        "gradient_checkpointing": args.gradient_checkpointing, "loss": cfg.loss, "repeats": args.repeats,
        "conditions": (f"{torch.get_num_threads()} torch thread(s); "
                       + ("two copies of this measurement at once (--side-by-side), as compare.py runs two arms"
                          if args.side_by_side else "alone; compare.py runs two arms side by side (--jobs 2): "
                          "--side-by-side measures under that load")),
        "seconds": "one round's generate_rollouts (R rollouts) / one update_step_engineered (B rollouts): median of repeats "
                   "after a warm-up call",
        "generation": generation, "training": training, "wall_seconds": time.time() - started,
    }
    if partner is not None:
        partner.wait()
        result["partner"] = json.load(open(partner_file)) if os.path.getsize(partner_file) else None
        os.remove(partner_file)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    print(f"curve: {args.output} ({result['wall_seconds']:.0f} s)")
    return result


def print_table(r: dict) -> None:
    print(f"\n{r['model']} on {r['device']} ({r['dtype']}, {r['threads']} thread(s)), task {r['task']} (prompts "
          f"~{r['prompt_tokens_mean']:.0f} tokens), <= {r['max_new_tokens']} new tokens"
          f"{' (forced to the limit)' if r['force_length'] else ''}; {r['conditions']}")
    rows = [(f"generation ({mode})", "R", p) for mode, points in r["generation"].items() for p in points]
    rows += [("training (update_step_engineered)", "B", p) for p in r["training"]]
    print(f"{'':<24}{'size':>6}{'seconds':>10}{'ms / rollout':>14}{'tokens / rollout':>18}")
    for name, key, p in rows:
        if "seconds" not in p:
            print(f"{name:<24}{p[key]:>6}  {p.get('error') or p.get('skipped')}")
            continue
        print(f"{name:<24}{p[key]:>6}{p['seconds']:>10.4f}{1000 * p['seconds'] / p[key]:>14.3f}"
              f"{p['mean_completion_tokens']:>18.1f}" + (f"   (first call {p['first_call_s']:.1f} s)"
                                                         if "first_call_s" in p else ""))


if __name__ == "__main__":
    main()
