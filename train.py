"""RL post-training with experience replay, in one loop.

    python train.py                      # the embedded demo: tiny model, 2-digit addition, CPU
    python train.py --help               # every knob, with its meaning

Each round: sample R = prompts_per_round x num_generations rollouts with the current policy,
add them to a FIFO buffer of N rollouts, then take K optimizer steps, each on B rollouts drawn
uniformly from the buffer. Replay ratio = K*B/R (mean uses of a rollout); staleness horizon =
N/R rounds (how long a rollout stays). On-policy training is N = R = B, K = 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

import torch

import tasks
from replay_rl import LOSS_TYPES, NORMALIZATIONS


def opt(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    # what to train
    model: str = opt("tiny", "HF model id or local folder; 'tiny' builds the embedded demo model for the task")
    warm_start_steps: int = opt(650, "tiny model only: supervised warm-start steps (fewer: weaker start, sparser rewards)")
    task: str = opt("addition", "task: 'addition' / 'addition3' (embedded, 2- / 3-digit sums), 'gsm8k' (openai/gsm8k) "
                                "or a .jsonl file of {question, answer: '... #### 42'} (last 10%% held out)")
    reward_mode: str = opt("strict", "GSM8K-format reward: strict needs '#### <number>', lenient takes the last number",
                           choices=("strict", "lenient"))
    reward: str = opt("", "custom reward, module:function or path/to/file.py:function, f(prompt, completion) -> float")
    chat_template: bool = opt(True, "wrap each prompt in the tokenizer's chat template when it has one")
    system_prompt: str = opt("", "a system message before each prompt (with the chat template)")
    output_dir: str = opt("", "run folder for metrics.jsonl, config.json and adapter/ (default runs/<time>)")
    seed: int = opt(0, "random seed (prompts, sampling, buffer)")
    # rollouts
    prompts_per_round: int = opt(32, "prompts sampled per round")
    num_generations: int = opt(8, "completions per prompt (G, the group for advantages)")
    max_new_tokens: int = opt(0, "longest completion; 0 = the task's own limit")
    temperature: float = opt(1.0, "sampling temperature (the loss uses the same scaling)")
    top_p: float = opt(1.0, "nucleus sampling; below 1 the stored log-probs ignore the truncation")
    # replay
    buffer_size: int = opt(256, "N: rollouts kept in the FIFO replay buffer (N = R = B, K = 1: on-policy)")
    batch_size: int = opt(256, "B: rollouts per optimizer step, sampled from the buffer")
    updates_per_round: int = opt(1, "K: optimizer steps per round")
    max_age: int = opt(0, "drop rollouts older than this many optimizer steps (checked before every update); "
                          "0 = no limit")
    reuse: bool = opt(True, "sampled rollouts stay in the buffer for later batches; --no-reuse: each is used once")
    keep_correct_frac: float = opt(0.0, "positive-bias retention: part of the buffer kept for the freshest "
                                        "correct (reward > 0) older rollouts; 0 = plain FIFO")
    skip_zero_advantage: bool = opt(False, "do not store rollouts with zero advantage (all-equal groups)")
    # loss and optimizer
    loss: str = opt("tis", "tis: truncated importance-weighted PG; ppo: clipped objective; "
                           "asymre: (r - (V - tau)) * log pi, no ratio", choices=LOSS_TYPES)
    asymre_tau: float = opt(0.1, "tau of the asymre loss (V - tau is the baseline)")
    is_cap: float = opt(2.0, "C: truncation cap of the importance weight (tis)")
    epsilon: float = opt(0.2, "clip range of the ppo loss")
    normalization: str = opt("token_mean", "loss normalization over the batch", choices=NORMALIZATIONS)
    lr: float = opt(1e-3, "AdamW learning rate of the LoRA weights")
    max_grad_norm: float = opt(1.0, "gradient clipping")
    lora_r: int = opt(16, "LoRA rank (all linear layers)")
    lora_alpha: int = opt(32, "LoRA alpha (scale = alpha / r)")
    micro_batch_size: int = opt(0, "rollouts per forward/backward (gradient accumulation); 0 = whole batch")
    beta: float = opt(0.0, "weight of a KL penalty to the base model (adapter off: no second copy); 0 = none")
    # length of the run and evaluation
    max_rounds: int = opt(600, "stop after this many rounds")
    max_gen_tokens: int = opt(0, "stop after the round in which this many completion tokens were generated; 0 = none")
    eval_every: int = opt(50, "greedy eval on held-out prompts every this many rounds")
    eval_every_tokens: int = opt(0, "eval instead whenever the generated tokens cross a multiple of this; 0 = off")
    eval_prompts: int = opt(500, "held-out prompts per eval (at most the task's eval set)")
    device: str = opt("auto", "cpu, cuda, mps or auto")
    progress: bool = opt(True, "show the progress bar and the start-up summary")
    dtype: str = opt("auto", "weights and compute: auto = bfloat16 on a GPU that supports it, else float32",
                     choices=("auto", "float32", "bfloat16"))
    load_in_4bit: bool = opt(False, "load the base model in 4-bit (bitsandbytes nf4, double quantization)")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward: less memory, slower")
    trust_remote_code: bool = opt(False, "run model code shipped with the model (off unless you trust it)")
    # checkpoints and failures
    save_every: int = opt(0, "checkpoint every this many rounds; 0 = only at the end and on interruption")
    keep_checkpoints: int = opt(2, "checkpoints kept in the run folder (older ones are deleted)")
    resume: str = opt("", "continue from a checkpoint folder, or from the latest checkpoint of a run folder")
    on_reward_error: str = opt("raise", "a reward function that raises: stop (raise) or score 0 and count it (zero)",
                               choices=("raise", "zero"))
    max_skipped_steps: int = opt(5, "stop after this many steps in a row skipped for a NaN/inf loss or gradient")

    @property
    def rollouts_per_round(self) -> int:
        return self.prompts_per_round * self.num_generations


# Fields a resumed run must keep: the checkpoint's weights, buffer and prompt stream depend on them.
RESUME_FIXED = ("model", "warm_start_steps", "task", "reward_mode", "reward", "chat_template", "system_prompt",
                "seed", "lora_r", "lora_alpha", "load_in_4bit", "buffer_size", "prompts_per_round", "num_generations",
                "temperature")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")     # one line, no usage dump, no traceback


def build_parser(explicit_only: bool = False) -> argparse.ArgumentParser:
    """The CLI, one flag per Config field. explicit_only: flags not given are left out of the result."""
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                           argument_default=argparse.SUPPRESS if explicit_only else None)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        default = argparse.SUPPRESS if explicit_only else f.default
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
        else:
            extra = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
            parser.add_argument(flag, type=type(f.default), default=default, metavar=type(f.default).__name__.upper(),
                                help=f.metadata["help"] + " (default: %(default)s)", **extra)
    return parser


def parse_config(argv=None) -> Config:
    """Flags -> Config, checked before anything is loaded. With --resume, the checkpoint's config
    is the base and the flags given on the command line override it."""
    parser = build_parser()
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.resume:
        checkpoint = find_checkpoint(cfg.resume)
        if checkpoint is None:
            parser.error(f"--resume {cfg.resume}: no checkpoint there (a checkpoint-<round> folder with state.json)")
        with open(os.path.join(checkpoint, "state.json")) as f:
            saved = json.load(f)["config"]
        given = vars(build_parser(explicit_only=True).parse_args(argv))
        changed = [f"--{k.replace('_', '-')} (saved {saved[k]!r}, given {given[k]!r})"
                   for k in RESUME_FIXED if k in given and given[k] != saved[k]]
        if changed:
            parser.error(f"--resume {checkpoint}: these fields cannot change on resume: {', '.join(changed)}")
        run_dir = os.path.dirname(os.path.abspath(checkpoint))
        cfg = Config(**{**saved, **given, "resume": checkpoint, "output_dir": run_dir})
    problem = config_problem(cfg)
    if problem:
        parser.error(problem)       # one line, exit code 2, before any model is loaded
    return cfg


def config_problem(cfg: Config) -> str | None:
    """The first rule the config breaks, as one line naming the field, the value and the rule."""
    for name in ("prompts_per_round", "num_generations", "buffer_size", "batch_size", "updates_per_round",
                 "max_rounds", "eval_every", "eval_prompts", "lora_r", "lr", "temperature", "keep_checkpoints",
                 "warm_start_steps", "max_grad_norm", "lora_alpha",
                 "max_skipped_steps"):
        if getattr(cfg, name) <= 0:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be > 0"
    for name in ("max_new_tokens", "max_gen_tokens", "max_age", "micro_batch_size", "save_every",
                 "eval_every_tokens"):
        if getattr(cfg, name) < 0:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0"
    if cfg.task not in tasks.TASK_NAMES and not cfg.task.endswith(".jsonl"):
        return f"--task {cfg.task}: unknown; expected {', '.join(tasks.TASK_NAMES)} or a path to a .jsonl file"
    if cfg.task.endswith(".jsonl") and not os.path.isfile(cfg.task):
        return f"--task {cfg.task}: no such file"
    if cfg.batch_size > cfg.buffer_size:
        return f"--batch-size {cfg.batch_size}: must be <= --buffer-size {cfg.buffer_size}"
    if cfg.buffer_size < cfg.rollouts_per_round:
        return (f"--buffer-size {cfg.buffer_size}: must hold at least one round "
                f"(prompts_per_round x num_generations = {cfg.rollouts_per_round})")
    if cfg.num_generations == 1 and cfg.loss != "asymre":
        return (f"--num-generations 1: a group of one has advantage 0, so the {cfg.loss} loss has no gradient; "
                "use 2 or more (asymre, whose coefficient r - (V - tau) is tau there, can train with 1)")
    if cfg.skip_zero_advantage and cfg.loss == "asymre":
        return ("--skip-zero-advantage with --loss asymre: asymre trains on all-equal groups too (coefficient "
                "tau, not 0), so the filter would change its objective; use it with tis or ppo")
    if not 0 <= cfg.keep_correct_frac < 1:
        return f"--keep-correct-frac {cfg.keep_correct_frac}: must be in [0, 1)"
    if cfg.beta < 0:
        return f"--beta {cfg.beta}: must be >= 0"
    if cfg.is_cap < 1:
        return f"--is-cap {cfg.is_cap}: must be >= 1 (a cap below 1 down-weights even on-policy tokens)"
    if not 0 < cfg.top_p <= 1:
        return f"--top-p {cfg.top_p}: must be in (0, 1]"
    if not 0 < cfg.epsilon < 1:
        return f"--epsilon {cfg.epsilon}: must be in (0, 1)"
    return None


def pick_dtype(name: str, device: str) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if device.startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32


def pick_device(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


# ---- checkpoints: checkpoint-<round>/{adapter/, optimizer.pt, buffer.safetensors, rng.safetensors, state.json}
def checkpoint_rounds(run_dir: str) -> list[int]:
    """Rounds of the checkpoint-<round> folders in a run folder, in order (not the hidden temporary ones)."""
    return sorted(int(m.group(1)) for d in os.listdir(run_dir) if (m := re.fullmatch(r"checkpoint-(\d+)", d)))


def find_checkpoint(path: str) -> str | None:
    """path itself if it is a checkpoint, else the newest complete checkpoint-<round> inside it."""
    if os.path.isfile(os.path.join(path, "state.json")):
        return path
    if not os.path.isdir(path):
        return None
    rounds = [r for r in checkpoint_rounds(path)
              if os.path.isfile(os.path.join(path, f"checkpoint-{r}", "state.json"))]
    return os.path.join(path, f"checkpoint-{rounds[-1]}") if rounds else None


def save_checkpoint(run_dir: str, model, optimizer, buffer, state: dict, rng: random.Random, cfg: Config) -> str:
    """Write everything needed to continue exactly, atomically: into a hidden temporary folder
    first, state.json last, then one rename. A crash mid-write leaves the older checkpoints intact."""
    from safetensors.torch import save_file

    final = os.path.join(run_dir, f"checkpoint-{state['round']}")
    tmp = os.path.join(run_dir, f".tmp-checkpoint-{state['round']}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(os.path.join(tmp, "adapter"))
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    save_file(buffer.state_dict(), os.path.join(tmp, "buffer.safetensors"))
    rng_state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng_state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    save_file(rng_state, os.path.join(tmp, "rng.safetensors"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump({"state": state, "python_rng": rng.getstate(), "config": dataclasses.asdict(cfg)}, f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for r in checkpoint_rounds(run_dir)[:-cfg.keep_checkpoints]:
        shutil.rmtree(os.path.join(run_dir, f"checkpoint-{r}"), ignore_errors=True)
    return final


def load_checkpoint(path: str, model, optimizer, buffer, rng: random.Random) -> tuple[dict, dict]:
    """Restore weights, optimizer, buffer and RNG streams in place; returns the saved loop state and config.
    Only tensors and JSON are read (safetensors, torch.load with weights_only=True): no pickles."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    set_peft_model_state_dict(model, load_file(os.path.join(path, "adapter", "adapter_model.safetensors"),
                                               device=str(device)))
    optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), map_location=device, weights_only=True))
    buffer.load_state_dict(load_file(os.path.join(path, "buffer.safetensors")))
    rng_state = load_file(os.path.join(path, "rng.safetensors"))
    torch.set_rng_state(rng_state["torch"])
    if "cuda" in rng_state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng_state["cuda"]))
    with open(os.path.join(path, "state.json")) as f:
        saved = json.load(f)
    version, internal, gauss = saved["python_rng"]
    rng.setstate((version, tuple(internal), gauss))
    return saved["state"], saved["config"]


class StopRequest:
    """First Ctrl-C / SIGTERM: finish the current step, save, exit. A second Ctrl-C exits at once."""

    def __init__(self):
        self.signum = None
        self.previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}

    def __call__(self, signum, frame):
        self.signum = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(Ctrl-C again to exit at once, without saving)", file=sys.stderr, flush=True)

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class RewardError(RuntimeError):
    pass


OOM_HELP = ("out of GPU memory. Turn one of these down/on and rerun (or --resume): --load-in-4bit, "
            "--micro-batch-size (e.g. 8), --batch-size, --num-generations, --max-new-tokens, "
            "or a smaller --model")


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
    try:
        task = tasks.load_task(cfg.task, reward_mode=cfg.reward_mode)
        if cfg.reward:
            task = dataclasses.replace(task, reward=tasks.load_reward(cfg.reward))
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    if cfg.prompts_per_round > len(task.train_prompts):
        print(f"train.py: error: --prompts-per-round {cfg.prompts_per_round}: the task has only "
              f"{len(task.train_prompts)} training prompts", file=sys.stderr)
        sys.exit(2)
    if cfg.model == "tiny" and task.target is None:
        sys.exit(f"error: --model tiny is the embedded demo for --task addition; for {cfg.task} pass a real "
                 "model, e.g. --model Qwen/Qwen2.5-0.5B-Instruct")
    stop = StopRequest()
    try:
        return train(cfg, task, stop)
    except torch.OutOfMemoryError:
        sys.exit(f"error: {OOM_HELP}")
    except RewardError as e:
        sys.exit(f"error: {e}")
    finally:
        stop.restore()


def train(cfg: Config, task, stop: StopRequest) -> dict:
    from buffer import ReplayBuffer
    from replay_rl import load_policy, update_step
    from rollout import generate_rollouts, greedy_rewards
    from tqdm import tqdm

    out = cfg.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)

    device = pick_device(cfg.device)
    say = print if cfg.progress else (lambda *args, **kwargs: None)
    model_path = tasks.tiny_model(task, cfg.warm_start_steps) if cfg.model == "tiny" else cfg.model
    torch.manual_seed(cfg.seed)                   # after the warm start, which may have used the RNG
    rng = random.Random(cfg.seed)                 # the prompt stream
    dtype = pick_dtype(cfg.dtype, device)
    if not os.path.isdir(model_path):
        tasks.use_local_cache_if_offline()
    try:
        model, tokenizer = load_policy(model_path, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                       load_in_4bit=cfg.load_in_4bit, device=device, dtype=dtype,
                                       gradient_checkpointing=cfg.gradient_checkpointing,
                                       trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.exit(f"error: --model {cfg.model}: cannot be loaded ({first}); pass a local folder, or download it "
                 "once with network (it is then cached)")
    if cfg.chat_template and tokenizer.chat_template:       # instruct models; base models have none
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        task = tasks.format_prompts(task, lambda p: tokenizer.apply_chat_template(
            system + [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True))
    elif cfg.system_prompt:
        sys.exit("error: --system-prompt needs a tokenizer with a chat template")
    on_gpu = device.startswith("cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    buffer = ReplayBuffer(cfg.buffer_size, max_age=cfg.max_age or None, seed=cfg.seed,
                          keep_correct_frac=cfg.keep_correct_frac, skip_zero_advantage=cfg.skip_zero_advantage)
    max_new_tokens = cfg.max_new_tokens or task.max_new_tokens
    eval_prompts = task.eval_prompts[:cfg.eval_prompts]

    R, N, B, K = cfg.rollouts_per_round, cfg.buffer_size, cfg.batch_size, cfg.updates_per_round
    n_total = sum(p.numel() for p in model.parameters())
    say(f"model {model_path} on {device} ({str(dtype).replace('torch.', '')}"
        f"{', 4-bit' if cfg.load_in_4bit else ''}): {n_total / 1e6:.2f}M parameters, "
        f"{sum(p.numel() for p in params) / 1e6:.3f}M trainable (LoRA r={cfg.lora_r})")
    say(f"task {task.name}: {len(task.train_prompts)} training prompts, {len(eval_prompts)} held-out eval prompts")
    say(f"round: R={R} new rollouts ({cfg.prompts_per_round} prompts x {cfg.num_generations}); "
        f"K={K} updates of B={B} from a buffer of N={N}")
    say(f"replay ratio K*B/R = {K * B / R:.2f} uses per rollout; staleness horizon N/R = {N / R:.1f} rounds; "
        f"loss {cfg.loss} (is_cap {cfg.is_cap}), lr {cfg.lr}")

    # Everything the loop needs to continue exactly is in `state` (plus weights, optimizer, buffer, RNGs).
    state = {"step": 0, "round": 0, "gen_tokens": 0, "gen_seconds": 0.0, "train_seconds": 0.0,
             "skipped_steps": 0, "skipped_in_a_row": 0, "reward_errors": 0, "eval_reward_errors": 0,
             "pending_updates": 0, "round_batch_size": B, "lapsed_updates": 0,
             "round_stats": {}, "first_accuracy": None, "last_accuracy": None, "last_eval_round": -1,
             "next_eval_tokens": cfg.eval_every_tokens, "idle_rounds": 0, "metrics_bytes": 0}
    metrics_path = os.path.join(out, "metrics.jsonl")
    if cfg.resume:
        state, saved_cfg = load_checkpoint(cfg.resume, model, optimizer, buffer, rng)
        state.setdefault("round_batch_size", saved_cfg["batch_size"])      # checkpoints from before these fields
        state.setdefault("lapsed_updates", 0)
        state.setdefault("eval_reward_errors", 0)
        saved_K = saved_cfg["updates_per_round"]
        for group in optimizer.param_groups:        # the optimizer state brought the old lr back
            group["lr"] = cfg.lr
        with open(metrics_path, "a") as f:          # drop lines written after the checkpoint
            f.truncate(state["metrics_bytes"])
        for r in checkpoint_rounds(out):            # and later checkpoints: that timeline is abandoned
            if r > state["round"]:
                shutil.rmtree(os.path.join(out, f"checkpoint-{r}"))
        say(f"resumed from {cfg.resume}: round {state['round']}, step {state['step']}")
        if state["pending_updates"] and (state["round_batch_size"] != B or saved_K != K):
            # The interrupted round's updates were decided with the saved B and K: they finish as decided.
            say(f"the interrupted round finishes its {state['pending_updates']} remaining update(s) with the saved "
                f"B={state['round_batch_size']}; --batch-size {B} / --updates-per-round {K} apply from round "
                f"{state['round'] + 1}")
    metrics_file = open(metrics_path, "a" if cfg.resume else "w")
    counters = ("step", "round", "gen_tokens", "gen_seconds", "train_seconds", "skipped_steps", "reward_errors",
                "idle_rounds", "lapsed_updates")

    def log(row: dict) -> None:
        metrics_file.write(json.dumps({**{k: state[k] for k in counters}, **row}) + "\n")
        metrics_file.flush()
        state["metrics_bytes"] = metrics_file.tell()

    def reward(prompt: str, completion: str, counter: str = "reward_errors") -> float:
        try:
            value = float(task.reward(prompt, completion))
            if not math.isfinite(value):
                raise ValueError(f"non-finite reward {value}")
            return value
        except Exception as e:
            if cfg.on_reward_error == "zero":
                state[counter] += 1
                return 0.0
            raise RewardError(f"the reward function failed on prompt {prompt!r} with completion {completion!r}: "
                              f"{type(e).__name__}: {e} (--on-reward-error zero scores such cases 0)") from e

    def evaluate() -> float:
        model.eval()
        # eval_accuracy: the training reward; plus the task's own (GSM8K: eval_strict, eval_lenient)
        eval_reward = lambda prompt, completion: reward(prompt, completion, "eval_reward_errors")
        scores = greedy_rewards(model, tokenizer, eval_prompts,
                                {"eval_accuracy": eval_reward, **{f"eval_{k}": f for k, f in task.eval_rewards.items()}},
                                max_new_tokens=max_new_tokens)
        model.train()
        log({**scores, "eval_reward_errors": state["eval_reward_errors"]})
        acc = scores["eval_accuracy"]
        state["last_accuracy"], state["last_eval_round"] = acc, state["round"]
        if state["first_accuracy"] is None:
            state["first_accuracy"] = acc
        return acc

    def checkpoint() -> str:
        return save_checkpoint(out, model, optimizer, buffer, state, rng, cfg)

    if state["first_accuracy"] is None:
        evaluate()                                  # step 0: before any update
    bar = tqdm(total=cfg.max_rounds, initial=state["round"], desc="rounds", dynamic_ncols=True,
               disable=not cfg.progress)

    def budget_spent() -> bool:
        return state["round"] >= cfg.max_rounds or 0 < cfg.max_gen_tokens <= state["gen_tokens"]

    def save_and_exit():
        bar.close()
        path = checkpoint()
        print(f"interrupted: checkpoint saved to {path}\nresume with: python train.py --resume {out}",
              file=sys.stderr)
        metrics_file.close()
        sys.exit(128 + stop.signum)

    while state["pending_updates"] or not budget_spent():
        if not state["pending_updates"]:            # a new round: generate, then K updates
            state["round"] += 1
            prompts = rng.sample(task.train_prompts, cfg.prompts_per_round)
            t0 = time.perf_counter()
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            model.eval()
            rollouts, gen = generate_rollouts(model, tokenizer, prompts, reward,
                                              num_generations=cfg.num_generations, max_new_tokens=max_new_tokens,
                                              temperature=cfg.temperature, top_p=cfg.top_p,
                                              policy_version=state["step"])
            model.train()
            state["gen_seconds"] += time.perf_counter() - t0
            if on_gpu:      # what generation needs: allocated by tensors, and reserved by the allocator
                gen_peaks = {"gen_peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
                             "gen_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}
                torch.cuda.reset_peak_memory_stats()
            state["gen_tokens"] += gen["new_tokens"]
            state["round_stats"] = {k: gen[k] for k in ("reward", "rollout_entropy", "zero_adv_frac",
                                                         "completion_len", "truncated_frac")}
            if on_gpu:
                state["round_stats"].update(gen_peaks)
            buffer.add(rollouts)
            buffer.drop_stale(state["step"])
            state["pending_updates"] = K if len(buffer) >= B else 0   # until the buffer holds B: generate only
            state["round_batch_size"] = B
            state["idle_rounds"] += not state["pending_updates"]
        while state["pending_updates"] and stop.signum is None:
            buffer.drop_stale(state["step"])        # --max-age holds at every update, not only once a round
            if len(buffer) < state["round_batch_size"]:     # too few rollouts young enough: the rest lapse
                state["lapsed_updates"] += state["pending_updates"]
                state["pending_updates"] = 0
                break
            t0 = time.perf_counter()
            batch = buffer.sample(state["round_batch_size"], remove=not cfg.reuse)
            m = update_step(model, optimizer, batch, pad_id=tokenizer.pad_token_id,
                            policy_version=state["step"], loss_type=cfg.loss, is_cap=cfg.is_cap,
                            epsilon=cfg.epsilon, normalization=cfg.normalization, temperature=cfg.temperature,
                            beta=cfg.beta, asymre_tau=cfg.asymre_tau, micro_batch_size=cfg.micro_batch_size,
                            max_grad_norm=cfg.max_grad_norm)
            if on_gpu:      # peak GPU memory of training (since generation), and of the round
                rs = state["round_stats"]
                rs["train_peak_mem_gb"] = max(rs.get("train_peak_mem_gb", 0.0), torch.cuda.max_memory_allocated() / 2**30)
                rs["train_reserved_gb"] = max(rs.get("train_reserved_gb", 0.0), torch.cuda.max_memory_reserved() / 2**30)
                rs["peak_mem_gb"] = max(rs.get("gen_peak_mem_gb", 0.0), rs["train_peak_mem_gb"])
            state["step"] += 1
            state["pending_updates"] -= 1
            state["train_seconds"] += time.perf_counter() - t0
            state["skipped_steps"] += m["skipped"]
            state["skipped_in_a_row"] = state["skipped_in_a_row"] + 1 if m["skipped"] else 0
            log({**m, **state["round_stats"], "buffer_size": len(buffer), "lr": optimizer.param_groups[0]["lr"]})
            if state["skipped_in_a_row"] >= cfg.max_skipped_steps:
                sys.exit(f"error: {state['skipped_in_a_row']} steps in a row had a NaN/inf loss or gradient "
                         f"(skipped, weights unchanged); lower --lr or check the reward. Last checkpoint: "
                         f"{find_checkpoint(out) or 'none'}")
        if stop.signum is not None and state["pending_updates"]:
            save_and_exit()                         # mid-round: its remaining updates run after --resume
        # the end of a round
        if cfg.eval_every_tokens:                   # at fixed token counts: curves of runs line up
            if state["gen_tokens"] >= state["next_eval_tokens"]:
                state["next_eval_tokens"] = (state["gen_tokens"] // cfg.eval_every_tokens + 1) * cfg.eval_every_tokens
                evaluate()
        elif state["round"] % cfg.eval_every == 0:
            evaluate()
        rs = state["round_stats"]
        bar.update(state["round"] - bar.n)
        bar.set_postfix(reward=f"{rs.get('reward', 0):.2f}", acc=f"{state['last_accuracy']:.3f}",
                        step=state["step"], tokens=state["gen_tokens"],
                        **({"mem": f"{rs['peak_mem_gb']:.1f}G"} if "peak_mem_gb" in rs else {}))
        if cfg.save_every and state["round"] % cfg.save_every == 0:
            checkpoint()
        if stop.signum is not None:
            save_and_exit()
    bar.close()
    if state["last_eval_round"] != state["round"]:
        evaluate()
    checkpoint()
    metrics_file.close()
    model.save_pretrained(os.path.join(out, "adapter"))

    first, last = state["first_accuracy"], state["last_accuracy"]
    total = state["gen_seconds"] + state["train_seconds"]
    say(f"eval accuracy: {first:.3f} at step 0 -> {last:.3f} after {state['step']} steps ({last - first:+.3f})")
    say(f"generated {state['gen_tokens']} completion tokens in {state['round']} rounds; time generation "
        f"{state['gen_seconds']:.1f} s / training {state['train_seconds']:.1f} s "
        f"({100 * state['gen_seconds'] / max(total, 1e-9):.0f}% generating)")
    if state["skipped_steps"] or state["reward_errors"]:
        say(f"skipped steps (NaN/inf): {state['skipped_steps']}; reward errors scored 0: {state['reward_errors']}")
    generated, trained = state["round"] * R, state["step"] * B
    if generated and trained and state["train_seconds"] > 0:
        mu = (state["gen_seconds"] / generated) / (state["train_seconds"] / trained)
        # An on-policy run (R = B, K = 1) with as many updates generates B rollouts per update.
        on_policy_tokens = state["gen_tokens"] * trained / generated
        say(f"measured mu = {mu:.2f} (seconds to generate a rollout / to train on one); each rollout was used "
            f"{trained / generated:.2f} times on average: an on-policy run with as many updates would have generated "
            f"~{on_policy_tokens:,.0f} tokens, {on_policy_tokens - state['gen_tokens']:+,.0f} against this run")
    if state["idle_rounds"]:
        say(f"rounds without an update (the buffer held fewer than B={B} rollouts): {state['idle_rounds']}")
    if state["lapsed_updates"]:
        say(f"updates skipped because fewer than B rollouts were younger than --max-age {cfg.max_age}: "
            f"{state['lapsed_updates']}")
    say(f"run folder: {out} (metrics.jsonl, adapter/, checkpoint-{state['round']}/)")
    return {"first_accuracy": first, "final_accuracy": last, "output_dir": out, **state}


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("\ninterrupted again: exited at once, without saving")
