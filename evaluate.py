"""Evaluate a trained adapter on its task's held-out prompts, in one command.

    python evaluate.py RUN                      # a run folder: adapter/, or its newest checkpoint's
    python evaluate.py RUN --checkpoint 200     # the adapter of RUN/checkpoint-200
    python evaluate.py RUN --num-generations 8  # also pass@8: 8 samples a prompt at --temperature
    python evaluate.py ADAPTER --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k   # a bare adapter

The model is rebuilt as train.py built it, from the run's config (config.json, or a checkpoint's
state.json): the base model (the demo model with its warm start), the task and its reward, the chat
template and system prompt, dtype, 4-bit and max_new_tokens; then the adapter's weights go in
(safetensors, no pickles). Greedy completions of the held-out prompts are scored by the training
reward (eval_accuracy, as in train.py's eval lines: for the same prompts, the same figure as a run
of one process, batched alike) and by the task's named eval rewards (GSM8K: eval_strict,
eval_lenient). With --num-generations n, n samples per prompt give pass@k by the unbiased
estimator of Chen et al. 2021 (Codex), per prompt with c of its n samples correct (reward > 0):
    pass@k = 1 - binom(n - c, k) / binom(n, k),  averaged over the prompts,
reported for k = 1 (the mean fraction correct) and k = n (a prompt counts if any sample is correct).
One line a metric on stdout; all of them in eval.json in the folder that holds the adapter (the run,
or the checkpoint), or in --output.
"""
from __future__ import annotations

import argparse
import dataclasses
import filecmp
import json
import math
import os
import sys

from infra import checkpoint
from infra import cli
from infra import distributed
from infra import generation
from infra import loading
from infra import report
import rollout
from infra import runfolder
import train

BATCH = 256             # samples generated at once for pass@n


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="evaluate.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="RUN", help="a run folder of train.py, a checkpoint folder in "
                   "it, or an adapter folder")
    p.add_argument("--checkpoint", default="", metavar="ROUND", help="in a run folder: the "
                   "checkpoint to evaluate, its round (200) or its folder; default the final "
                   "adapter/, else the newest")
    p.add_argument("--model", default="", help="the base model (HF id, local folder or 'tiny'): "
                   "needed for a bare adapter; for a run it replaces the config's (a local copy)")
    p.add_argument("--task", default="", help="the task: needed for a bare adapter; for a run it "
                   "replaces the config's (another task's held-out set)")
    p.add_argument("--eval-prompts", type=int, default=0, metavar="N",
                   help="the first N held-out prompts (default 0: all of them)")
    p.add_argument("--num-generations", type=int, default=0, metavar="N",
                   help="samples per prompt for pass@1 and pass@N (default 0: greedy only)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="of the samples, with --num-generations (greedy decoding has none; "
                   "default: the run's sampling temperature, else 1.0)")
    p.add_argument("--output", default="", metavar="FILE", help="the JSON file to write "
                   "(default: eval.json in the folder that holds the adapter)")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (default)")
    return p


def parse(argv=None) -> argparse.Namespace:
    """The flags, the adapter and the run's config, checked before any model is loaded."""
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("eval_prompts", "num_generations"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0")
    if args.temperature is not None and not 0 < args.temperature < math.inf:
        p.error(f"--temperature {args.temperature}: must be a finite number > 0")
    if args.temperature is not None and not args.num_generations:
        p.error(f"--temperature {args.temperature}: applies to the samples of --num-generations N; "
                "the greedy eval has no temperature")
    if args.num_generations == 1:
        p.error("--num-generations 1: pass@n needs 2 or more samples a prompt (0: greedy only)")
    args.adapter, saved = locate(args.path, args.checkpoint, p)
    args.cfg = config(saved, args, p)
    args.in_run = saved is not None
    if args.temperature is None:
        args.temperature = args.cfg.temperature
    # the run's or the checkpoint's folder; an adapter outside a run: its own folder
    holder = os.path.dirname(os.path.abspath(args.adapter)) if args.in_run else args.adapter
    args.output = args.output or os.path.join(holder, "eval.json")
    if os.path.isdir(args.output):
        p.error(f"--output {args.output}: a folder; name the JSON file to write")
    folder, name = os.path.split(os.path.abspath(args.output))
    try:        # one writer of a file at a time: a second evaluate.py onto it is refused here
        runfolder.lock_folder(folder, f".{name}.lock", what="an evaluate.py writing it",
                               other="--output")
    except runfolder.RunFolderBusy as e:
        p.error(f"{args.output}: {e}")
    except runfolder.DiskFull as e:
        where, fix = runfolder.limit_in_words(e.reason, folder)
        p.error(f"--output {args.output}: cannot be written ({e.reason}: {where}); {fix}")
    except OSError as e:
        p.error(f"--output {args.output}: cannot be written ({e.strerror or e})")
    return args


def locate(path: str, which: str, parser) -> tuple[str, dict | None]:
    """(the adapter folder, the config of the run that trained it or None): from a run folder, a
    checkpoint folder, or an adapter folder (whose run is its parent folder, if it is in one)."""
    def read(folder):       # a run's config.json, or a checkpoint's state.json; else None
        for name, key in (("state.json", "config"), ("config.json", None)):
            file = os.path.join(folder, name)
            if os.path.isfile(file):
                with open(file) as f:
                    saved = json.load(f)
                saved = saved.get(key) if key else saved
                if isinstance(saved, dict) and {"model", "task", "lora_r"} <= saved.keys():
                    return saved
        return None

    if not os.path.isdir(path):
        parser.error(f"{path}: no such folder")
    if which:
        if read(path) is None or os.path.isfile(os.path.join(path, "state.json")):
            parser.error(f"--checkpoint {which}: {path} is not a run folder")
        found = which if os.path.isdir(which) else os.path.join(path, f"checkpoint-{which}")
        if not os.path.isfile(os.path.join(found, "state.json")):
            parser.error(f"--checkpoint {which}: no checkpoint there; {path} has rounds "
                         f"{checkpoint.rounds(path) or 'none'}")
        path = found
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        adapter, saved = path, read(os.path.dirname(os.path.abspath(path)))
    elif read(path) is None:
        parser.error(f"{path}: not a run folder of train.py (config.json), a checkpoint "
                     "(state.json) or an adapter folder (adapter_config.json)")
    elif os.path.isfile(os.path.join(path, "adapter", "adapter_config.json")):
        adapter, saved = os.path.join(path, "adapter"), read(path)
        newest = checkpoint.find(path)
        weights = lambda folder: os.path.join(folder, "adapter_model.safetensors")
        if newest and not filecmp.cmp(weights(adapter), weights(os.path.join(newest, "adapter")),
                                      shallow=False):   # resumed since its end, or abandoned
            print(f"{adapter} is not the newest checkpoint's: the run went on after it was "
                  f"written; evaluating {newest} (--checkpoint picks another)", file=sys.stderr)
            adapter, saved = os.path.join(newest, "adapter"), read(newest)
    elif checkpoint.find(path):             # a run without its final adapter (running, stopped)
        adapter, saved = os.path.join(checkpoint.find(path), "adapter"), read(checkpoint.find(path))
    else:
        parser.error(f"{path}: the run has no adapter/ and no checkpoint yet")
    if not os.path.isfile(os.path.join(adapter, "adapter_model.safetensors")):
        parser.error(f"{adapter}: no adapter_model.safetensors (other formats are not read: "
                     "pickles)")
    return adapter, saved


def config(saved: dict | None, args, parser) -> train.Config:
    """The training config, with --model, --task and --device; r and alpha of the adapter itself."""
    if saved is None and not (args.model and args.task):
        parser.error(f"{args.adapter}: an adapter outside a run folder; name its base model and "
                     "task: --model M --task T")
    if saved is not None:       # --model tiny too: it builds today's demo model, another base
        if problem := cli.stale_demo({**saved, "model": args.model or saved["model"]}):
            parser.error(f"{args.adapter}: {problem}")
    fields = {f.name for f in dataclasses.fields(train.Config)}
    cfg = train.Config(**{k: v for k, v in (saved or {}).items() if k in fields})
    with open(os.path.join(args.adapter, "adapter_config.json")) as f:
        lora = json.load(f)
    cfg = dataclasses.replace(cfg, model=args.model or cfg.model, task=args.task or cfg.task,
                              device=args.device, lora_r=lora["r"], lora_alpha=lora["lora_alpha"],
                              gradient_checkpointing=False, resume="")
    problem = cli.config_problem(cfg)
    if problem:
        parser.error(problem)
    return cfg


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021: the chance that k of n samples, c of them correct, hold a correct one."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_rates(rewards: list[list[float]]) -> dict[str, float]:
    """pass@1, pass@n and the mean reward of n samples per prompt (rewards: [prompts][n])."""
    n = len(rewards[0])
    correct = [sum(r > 0 for r in row) for row in rewards]
    return {"pass@1": sum(pass_at_k(n, c, 1) for c in correct) / len(rewards),
            f"pass@{n}": sum(pass_at_k(n, c, n) for c in correct) / len(rewards),
            "sampled_reward": sum(map(sum, rewards)) / (n * len(rewards))}


def sampled_rewards(model, tokenizer, prompts, reward, *, n, max_new_tokens, temperature):
    """[prompts][n] rewards of n samples per prompt (rollout.generate_rollouts), in batches."""
    from tqdm import tqdm

    rewards, per_batch = [], max(1, BATCH // n)
    for start in tqdm(range(0, len(prompts), per_batch), desc=f"{n} samples", disable=None):
        chunk = prompts[start:start + per_batch]
        rollouts, _ = rollout.generate_rollouts(model, tokenizer, chunk, reward, num_generations=n,
                                                max_new_tokens=max_new_tokens,
                                                temperature=temperature, policy_version=0,
                                                sampler=generation.recording_sampler())
        rewards += [[r.reward for r in rollouts[i * n:(i + 1) * n]] for i in range(len(chunk))]
    return rewards


def main(argv=None) -> dict:
    """python evaluate.py RUN [flags]: the figures, printed and written to eval.json."""
    from tqdm import tqdm

    args = parse(argv)
    cfg = args.cfg
    report.quiet_libraries()
    task = loading.load_task(cfg, training=False)
    device = distributed.pick_device(cfg.device)
    model, tokenizer, task = loading.load_model(cfg, task, device, rank=0)
    try:
        checkpoint.load_adapter(model, args.adapter)
    except (ValueError, RuntimeError) as e:         # another layout, or other shapes
        sys.exit(f"error: --model {cfg.model}: the adapter does not fit it "
                 f"({' '.join(str(e).split())[:300]})")
    model.eval()
    prompts = task.eval_prompts[:args.eval_prompts or len(task.eval_prompts)]
    limit = cfg.max_new_tokens or task.max_new_tokens
    print(f"{args.adapter}: model {cfg.model}, task {task.name}, {len(prompts)} held-out prompts, "
          f"up to {limit} new tokens")
    reward = loading.CheckedReward(task.reward, cfg.on_reward_error, cfg.reward_timeout)
    # train.py's eval: the training reward, then the task's named ones, in batches of the same size
    fns = loading.eval_rewards(task, reward)
    try:
        with tqdm(total=len(prompts), desc="greedy", disable=None) as bar:
            scores = generation.greedy_rewards(model, tokenizer, prompts, fns, max_new_tokens=limit,
                                            progress=bar)
    except loading.RewardError as e:    # one line (--on-reward-error zero scores such cases 0)
        sys.exit(f"error: {e}")
    notes = dict.fromkeys(scores, "greedy")
    notes["eval_accuracy"] = "greedy; the training reward, as in train.py's eval lines"
    n = args.num_generations
    if n:
        try:
            scores.update(pass_rates(sampled_rewards(model, tokenizer, prompts, reward, n=n,
                                                     max_new_tokens=limit,
                                                     temperature=args.temperature)))
        except loading.RewardError as e:
            sys.exit(f"error: {e}")
        notes.update({"pass@1": f"{n} samples a prompt at temperature {args.temperature}: the "
                                "mean fraction with a reward > 0",
                      f"pass@{n}": f"the fraction of prompts with a reward > 0 in at least one of "
                                   f"the {n} samples",
                      "sampled_reward": "the mean reward of the samples"})
    for name, value in scores.items():
        print(f"{name:<16} {value:.4f}   {notes[name]}")
    result = {"adapter": args.adapter, "model": cfg.model, "task": cfg.task, "device": device,
              "eval_prompts": len(prompts), "max_new_tokens": limit,
              **({"num_generations": n, "temperature": args.temperature} if n else {}),
              "reward_errors": reward.errors, **scores}
    write(args.output, result)
    print(f"written to {args.output}")
    return result


def write(path: str, result: dict) -> None:
    """eval.json written whole or not at all; a full disk (or another limit: runfolder.no_space)
    is one line."""
    try:
        runfolder.write_json(path, result, indent=2)
    except OSError as e:
        reason = runfolder.no_space(e, path)
        if not reason:
            raise
        where, fix = runfolder.limit_in_words(reason, os.path.dirname(path) or ".")
        sys.exit(f"error: {reason}: {path} could not be written ({where}); the figures above are "
                 f"all it held: {fix} and run evaluate.py again")


if __name__ == "__main__":
    main()
