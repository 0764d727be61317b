"""RL post-training with experience replay, in one loop.

    python train.py                      # the embedded demo: tiny model, 2-digit addition, CPU
    python train.py --help               # every knob, with its meaning

Each round: sample R = prompts_per_round x num_generations rollouts with the current policy,
add them to a FIFO buffer of N rollouts, then take K optimizer steps, each on B rollouts drawn
uniformly from the buffer. Replay ratio = K*B/R (mean uses of a rollout); staleness horizon =
N/R rounds (how long a rollout stays). On-policy training is N = R, K*B = R.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch

from replay_rl import LOSS_TYPES, NORMALIZATIONS


def opt(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    # what to train
    model: str = opt("tiny", "HF model id or local folder; 'tiny' builds the embedded demo model for the task")
    task: str = opt("addition", "task: 'addition' (embedded, 2-digit sums)")
    output_dir: str = opt("", "run folder for metrics.jsonl, config.json and adapter/ (default runs/<time>)")
    seed: int = opt(0, "random seed (prompts, sampling, buffer)")
    # rollouts
    prompts_per_round: int = opt(16, "prompts sampled per round")
    num_generations: int = opt(8, "completions per prompt (G, the group for advantages)")
    max_new_tokens: int = opt(0, "longest completion; 0 = the task's own limit")
    temperature: float = opt(1.0, "sampling temperature (the loss uses the same scaling)")
    top_p: float = opt(1.0, "nucleus sampling; below 1 the stored log-probs ignore the truncation")
    # replay
    buffer_size: int = opt(256, "N: rollouts kept in the FIFO replay buffer")
    batch_size: int = opt(128, "B: rollouts per optimizer step, sampled from the buffer")
    updates_per_round: int = opt(1, "K: optimizer steps per round")
    max_age: int = opt(0, "drop rollouts older than this many optimizer steps; 0 = no limit")
    # loss and optimizer
    loss: str = opt("tis", "tis: truncated importance-weighted PG; ppo: clipped objective", choices=LOSS_TYPES)
    is_cap: float = opt(2.0, "C: truncation cap of the importance weight (tis)")
    epsilon: float = opt(0.2, "clip range of the ppo loss")
    normalization: str = opt("token_mean", "loss normalization over the batch", choices=NORMALIZATIONS)
    lr: float = opt(1e-3, "AdamW learning rate of the LoRA weights")
    max_grad_norm: float = opt(1.0, "gradient clipping")
    lora_r: int = opt(16, "LoRA rank (all linear layers)")
    lora_alpha: int = opt(32, "LoRA alpha (scale = alpha / r)")
    micro_batch_size: int = opt(0, "rollouts per forward/backward (gradient accumulation); 0 = whole batch")
    # length of the run and evaluation
    max_rounds: int = opt(120, "stop after this many rounds")
    max_gen_tokens: int = opt(0, "stop once this many completion tokens were generated; 0 = no limit")
    eval_every: int = opt(10, "greedy eval on held-out prompts every this many rounds")
    eval_prompts: int = opt(500, "held-out prompts per eval (at most the task's eval set)")
    device: str = opt("auto", "cpu, cuda, mps or auto")
    load_in_4bit: bool = opt(False, "load the base model in 4-bit (bitsandbytes nf4)")

    @property
    def rollouts_per_round(self) -> int:
        return self.prompts_per_round * self.num_generations


def parse_config(argv=None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        extra = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, metavar=f.name.upper(),
                                help=f.metadata["help"] + " (default: %(default)s)", **extra)
    cfg = Config(**vars(parser.parse_args(argv)))
    problem = config_problem(cfg)
    if problem:
        parser.error(problem)       # one line, exit code 2, before any model is loaded
    return cfg


def config_problem(cfg: Config) -> str | None:
    """The first rule the config breaks, as one line naming the field, the value and the rule."""
    for name in ("prompts_per_round", "num_generations", "buffer_size", "batch_size", "updates_per_round",
                 "max_rounds", "eval_every", "eval_prompts", "lora_r", "lr", "temperature"):
        if getattr(cfg, name) <= 0:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be > 0"
    for name in ("max_new_tokens", "max_gen_tokens", "max_age", "micro_batch_size"):
        if getattr(cfg, name) < 0:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0"
    if cfg.batch_size > cfg.buffer_size:
        return f"--batch-size {cfg.batch_size}: must be <= --buffer-size {cfg.buffer_size}"
    if cfg.buffer_size < cfg.rollouts_per_round:
        return (f"--buffer-size {cfg.buffer_size}: must hold at least one round "
                f"(prompts_per_round x num_generations = {cfg.rollouts_per_round})")
    if cfg.is_cap < 1:
        return f"--is-cap {cfg.is_cap}: must be >= 1 (a cap below 1 down-weights even on-policy tokens)"
    if not 0 < cfg.top_p <= 1:
        return f"--top-p {cfg.top_p}: must be in (0, 1]"
    if not 0 < cfg.epsilon < 1:
        return f"--epsilon {cfg.epsilon}: must be in (0, 1)"
    return None


def pick_device(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def quiet_libraries() -> None:
    """Hide library chatter that says nothing about the run (weight-loading bars, optional kernels)."""
    import logging
    import warnings

    import transformers
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    warnings.filterwarnings("ignore", message=".*torch.jit.script_method.*")


def main(argv=None) -> dict:
    cfg = parse_config(argv)
    quiet_libraries()
    import tasks
    from buffer import ReplayBuffer
    from replay_rl import load_policy, update_step
    from rollout import generate_rollouts, greedy_accuracy
    from tqdm import tqdm

    try:
        task = tasks.load_task(cfg.task)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    out = cfg.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    device = pick_device(cfg.device)
    model_path = tasks.tiny_model(task) if cfg.model == "tiny" else cfg.model
    model, tokenizer = load_policy(model_path, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                   load_in_4bit=cfg.load_in_4bit, device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    buffer = ReplayBuffer(cfg.buffer_size, max_age=cfg.max_age or None, seed=cfg.seed)
    max_new_tokens = cfg.max_new_tokens or task.max_new_tokens
    eval_prompts = task.eval_prompts[:cfg.eval_prompts]

    R, N, B, K = cfg.rollouts_per_round, cfg.buffer_size, cfg.batch_size, cfg.updates_per_round
    n_total = sum(p.numel() for p in model.parameters())
    print(f"model {model_path} on {device}: {n_total / 1e6:.2f}M parameters, "
          f"{sum(p.numel() for p in params) / 1e6:.3f}M trainable (LoRA r={cfg.lora_r})")
    print(f"task {task.name}: {len(task.train_prompts)} training prompts, {len(eval_prompts)} held-out eval prompts")
    print(f"round: R={R} new rollouts ({cfg.prompts_per_round} prompts x {cfg.num_generations}); "
          f"K={K} updates of B={B} from a buffer of N={N}")
    print(f"replay ratio K*B/R = {K * B / R:.2f} uses per rollout; staleness horizon N/R = {N / R:.1f} rounds; "
          f"loss {cfg.loss} (is_cap {cfg.is_cap}), lr {cfg.lr}")

    metrics_file = open(os.path.join(out, "metrics.jsonl"), "w")
    state = {"step": 0, "round": 0, "gen_tokens": 0, "gen_seconds": 0.0, "train_seconds": 0.0}

    def log(row: dict) -> None:
        metrics_file.write(json.dumps({**state, **row}) + "\n")
        metrics_file.flush()

    def evaluate() -> float:
        model.eval()
        acc = greedy_accuracy(model, tokenizer, eval_prompts, task.reward, max_new_tokens=max_new_tokens)
        model.train()
        log({"eval_accuracy": acc})
        return acc

    first_acc = last_acc = evaluate()
    history = [(0, first_acc)]
    bar = tqdm(range(1, cfg.max_rounds + 1), desc="rounds", dynamic_ncols=True)
    for rnd in bar:
        state["round"] = rnd
        prompts = rng.sample(task.train_prompts, cfg.prompts_per_round)
        t0 = time.perf_counter()
        model.eval()
        rollouts, gen = generate_rollouts(model, tokenizer, prompts, task.reward,
                                          num_generations=cfg.num_generations, max_new_tokens=max_new_tokens,
                                          temperature=cfg.temperature, top_p=cfg.top_p,
                                          policy_version=state["step"])
        model.train()
        state["gen_seconds"] += time.perf_counter() - t0
        state["gen_tokens"] += gen["new_tokens"]
        buffer.add(rollouts)
        buffer.drop_stale(state["step"])

        t0 = time.perf_counter()
        for _ in range(K if len(buffer) >= B else 0):     # until the buffer holds B, a round only generates
            m = update_step(model, optimizer, buffer.sample(B), pad_id=tokenizer.pad_token_id,
                            policy_version=state["step"], loss_type=cfg.loss, is_cap=cfg.is_cap,
                            epsilon=cfg.epsilon, normalization=cfg.normalization, temperature=cfg.temperature,
                            micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm)
            state["step"] += 1
            state["train_seconds"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            log({**m, "reward": gen["reward"], "rollout_entropy": gen["rollout_entropy"],
                 "zero_adv_frac": gen["zero_adv_frac"], "completion_len": gen["completion_len"],
                 "buffer_size": len(buffer)})

        if rnd % cfg.eval_every == 0 or rnd == cfg.max_rounds:
            last_acc = evaluate()
            history.append((rnd, last_acc))
        bar.set_postfix(reward=f"{gen['reward']:.2f}", acc=f"{last_acc:.3f}", step=state["step"],
                        tokens=state["gen_tokens"])
        if cfg.max_gen_tokens and state["gen_tokens"] >= cfg.max_gen_tokens:
            break
    bar.close()
    if history[-1][0] != state["round"]:
        last_acc = evaluate()
    metrics_file.close()
    model.save_pretrained(os.path.join(out, "adapter"))

    total = state["gen_seconds"] + state["train_seconds"]
    print(f"eval accuracy: {first_acc:.3f} at step 0 -> {last_acc:.3f} after {state['step']} steps "
          f"({last_acc - first_acc:+.3f})")
    print(f"generated {state['gen_tokens']} completion tokens in {state['round']} rounds; time generation "
          f"{state['gen_seconds']:.1f} s / training {state['train_seconds']:.1f} s "
          f"({100 * state['gen_seconds'] / max(total, 1e-9):.0f}% generating)")
    print(f"run folder: {out} (metrics.jsonl, adapter/)")
    return {"first_accuracy": first_acc, "final_accuracy": last_acc, "output_dir": out, **state}


if __name__ == "__main__":
    main()
