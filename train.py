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
import importlib.util
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
    warm_start_steps: int = opt(2000, "tiny model only: warm-start steps on correct sums (then the sloppy teacher)")
    warm_start_seed: int = opt(0, "tiny model only: seed of its warm start (0: the weights shipped in demo.safetensors)")
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
    prompts_per_round: int = opt(16, "prompts sampled per round (16 x 8 = 128 new rollouts for B = N = 256: "
                                     "the paper's replay, each rollout used twice; 32: on-policy)")
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
    max_rounds: int = opt(200, "stop after this many rounds")
    max_gen_tokens: int = opt(0, "stop after the round in which this many completion tokens were generated; 0 = none")
    eval_every: int = opt(25, "greedy eval on held-out prompts every this many rounds")
    eval_every_tokens: int = opt(0, "eval instead whenever the generated tokens cross a multiple of this; 0 = off")
    eval_prompts: int = opt(500, "held-out prompts per eval (at most the task's eval set)")
    device: str = opt("auto", "cpu, cuda, mps or auto")
    progress: bool = opt(True, "show the progress bar and the start-up summary")
    plot: bool = opt(True, "draw curves.png in the run folder at each eval and at the end (needs matplotlib)")
    report_to: str = opt("none", "also write the metrics as TensorBoard event files in the run folder",
                         choices=("none", "tensorboard"))
    dtype: str = opt("auto", "weights and compute: auto = bfloat16 on a GPU that supports it, else float32",
                     choices=("auto", "float32", "bfloat16"))
    load_in_4bit: bool = opt(False, "load the base model in 4-bit (bitsandbytes nf4, double quantization)")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward: less memory, slower")
    fast_generation: bool = opt(False, "on a GPU: a static KV cache kept for the run, so transformers compiles "
                                       "the decode step (CUDA graphs); the first round compiles (slow)")
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
RESUME_FIXED = ("model", "warm_start_steps", "warm_start_seed", "task", "reward_mode", "reward", "chat_template", "system_prompt",
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
        if checkpoint != cfg.resume.rstrip("/"):        # a run folder: the newest checkpoint that reads back
            checkpoint = newest_loadable_checkpoint(cfg.resume, parser)
        elif problem := checkpoint_problem(checkpoint):
            parser.error(f"--resume {checkpoint}: damaged checkpoint, {problem}")
        with open(os.path.join(checkpoint, "state.json")) as f:
            saved_all = json.load(f)
        saved = saved_all["config"]
        saved_world = saved_all["state"].get("world_size", 1)
        if saved_world != world_size():
            parser.error(f"--resume {checkpoint}: saved by {saved_world} process(es), resumed with {world_size()}: "
                         f"each process holds its own buffer shard; resume with {saved_world}")
        given = vars(build_parser(explicit_only=True).parse_args(argv))
        changed = [f"--{k.replace('_', '-')} (saved {saved[k]!r}, given {given[k]!r})"
                   for k in RESUME_FIXED if k in given and given[k] != saved.get(k, getattr(Config, k))]
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
    for name in ("warm_start_seed", "max_new_tokens", "max_gen_tokens", "max_age", "micro_batch_size", "save_every",
                 "eval_every_tokens"):
        if getattr(cfg, name) < 0:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0"
    if cfg.task not in tasks.TASK_NAMES and not cfg.task.endswith(".jsonl"):
        return f"--task {cfg.task}: unknown; expected {', '.join(tasks.TASK_NAMES)} or a path to a .jsonl file"
    if cfg.task.endswith(".jsonl") and not os.path.isfile(cfg.task):
        return f"--task {cfg.task}: no such file"
    W = world_size()
    for name in ("prompts_per_round", "batch_size", "buffer_size"):
        if getattr(cfg, name) % W:
            return (f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be a multiple of the number of "
                    f"processes ({W}): each generates, keeps and samples its share")
    if cfg.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        return "--report-to tensorboard: the tensorboard package is not installed (pip install tensorboard)"
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


# ---- several processes (torchrun): each generates, keeps and samples its share ------------------
# Data parallel over W processes: R, N and B stay global; each rank generates R/W rollouts from
# its share of the round's prompts (whole groups, so advantages are computed where the group
# lives), keeps a buffer shard of N/W and samples B/W per update; update_step sums the gradients
# over the ranks. One process (plain `python train.py`) never touches torch.distributed.
def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: str) -> int:
    """This process's rank; joins the process group under torchrun: nccl for GPU tensors (each rank
    on its own GPU, LOCAL_RANK), gloo for CPU tensors (the small counts, and everything on a CPU)."""
    if world_size() == 1:
        return 0
    import torch.distributed as dist
    if not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank()


def all_ranks(values: list[float], op: str = "sum") -> list[float]:
    """values summed (or their "min" / "max") over the ranks; unchanged in one process."""
    from replay_rl import over_processes
    return over_processes(torch.tensor(values, dtype=torch.float64), op).tolist()


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


# ---- checkpoints: checkpoint-<round>/{adapter/, optimizer.pt, buffer.safetensors, rng.safetensors, state.json}
# (with W processes, rank r > 0 adds buffer-rank<r>.safetensors and rng-rank<r>.safetensors)
def checkpoint_rounds(run_dir: str) -> list[int]:
    """Rounds of the checkpoint-<round> folders in a run folder, in order (not the hidden temporary ones)."""
    return sorted(int(m.group(1)) for d in os.listdir(run_dir) if (m := re.fullmatch(r"checkpoint-(\d+)", d)))


def find_checkpoint(path: str) -> str | None:
    """path itself if it is a checkpoint, else the newest complete checkpoint-<round> inside it."""
    found = checkpoints_newest_first(path)
    return found[0] if found else None


def checkpoints_newest_first(path: str) -> list[str]:
    if os.path.isfile(os.path.join(path, "state.json")):
        return [path.rstrip("/")]
    if not os.path.isdir(path):
        return []
    return [os.path.join(path, f"checkpoint-{r}") for r in reversed(checkpoint_rounds(path))
            if os.path.isfile(os.path.join(path, f"checkpoint-{r}", "state.json"))]


def shard_name(kind: str, rank: int) -> str:
    return f"{kind}.safetensors" if rank == 0 else f"{kind}-rank{rank}.safetensors"


def checkpoint_problem(path: str) -> str | None:
    """The first file of a checkpoint that does not read back, as 'file (reason)'; None if all do."""
    from safetensors.torch import load_file
    try:
        with open(os.path.join(path, "state.json")) as f:
            world = json.load(f)["state"].get("world_size", 1)
    except (OSError, ValueError, KeyError) as e:
        return f"state.json ({type(e).__name__}: {e})"
    files = ["adapter/adapter_model.safetensors"] + [shard_name(k, r) for r in range(world) for k in ("buffer", "rng")]
    for name in files + ["optimizer.pt"]:
        try:
            if name.endswith(".pt"):
                torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
            else:
                load_file(os.path.join(path, name))
        except Exception as e:          # truncated, missing, not a tensor file: all mean "cannot resume from it"
            return f"{name} ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"
    return None


def newest_loadable_checkpoint(run_dir: str, parser) -> str:
    """The newest checkpoint of a run folder whose files all read back; says which ones were skipped."""
    for checkpoint in checkpoints_newest_first(run_dir):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        print(f"skipping {checkpoint}: damaged, {problem}", file=sys.stderr)
    parser.error(f"--resume {run_dir}: no checkpoint there reads back (all damaged)")


def save_checkpoint(run: Run) -> str:
    """Write everything needed to continue exactly, atomically: into a hidden temporary folder
    first, state.json last, then one rename. A crash mid-write leaves the older checkpoints intact."""
    from safetensors.torch import save_file

    state, out = run.state, run.out
    final = os.path.join(out, f"checkpoint-{state['round']}")
    tmp = os.path.join(out, f".tmp-checkpoint-{state['round']}")
    if run.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    save_file(run.buffer.state_dict(), os.path.join(tmp, shard_name("buffer", run.rank)))
    rng_state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng_state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    save_file(rng_state, os.path.join(tmp, shard_name("rng", run.rank)))
    barrier()
    if run.rank == 0:           # the weights and the optimizer state are the same on every rank
        run.model.save_pretrained(os.path.join(tmp, "adapter"))
        torch.save(run.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump({"state": state, "python_rng": run.rng.getstate(), "config": dataclasses.asdict(run.cfg)}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for r in checkpoint_rounds(out)[:-run.cfg.keep_checkpoints]:
            shutil.rmtree(os.path.join(out, f"checkpoint-{r}"), ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path: str, run: Run) -> tuple[dict, dict]:
    """Restore weights, optimizer, buffer and RNG streams in place; returns the saved loop state and config.
    Only tensors and JSON are read (safetensors, torch.load with weights_only=True): no pickles."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    device = next(run.model.parameters()).device
    set_peft_model_state_dict(run.model, load_file(os.path.join(path, "adapter", "adapter_model.safetensors"),
                                                   device=str(device)))
    run.optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), map_location=device,
                                             weights_only=True))
    run.buffer.load_state_dict(load_file(os.path.join(path, shard_name("buffer", run.rank))))
    rng_state = load_file(os.path.join(path, shard_name("rng", run.rank)))
    torch.set_rng_state(rng_state["torch"])
    if "cuda" in rng_state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng_state["cuda"]))
    with open(os.path.join(path, "state.json")) as f:
        saved = json.load(f)
    version, internal, gauss = saved["python_rng"]
    run.rng.setstate((version, tuple(internal), gauss))
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


# ---- the loop -------------------------------------------------------------------------------
def train(cfg: Config, task, stop: StopRequest) -> dict:
    """The loop of the README: each round generate, add to the buffer, K updates; eval, save."""
    run = setup(cfg, task)
    state = run.state
    if state["first_accuracy"] is None:
        evaluate(run)                               # step 0: before any update
    while state["pending_updates"] or not budget_spent(run):
        if not state["pending_updates"]:
            generate_round(run)                     # R new rollouts into the buffer; decides the round's K updates
        while state["pending_updates"] and not stopping(run, stop):
            update(run)                             # one optimizer step on B rollouts sampled from the buffer
        if stopping(run, stop) and state["pending_updates"]:
            save_and_exit(run, stop)                # mid-round: its remaining updates run after --resume
        end_of_round(run)                           # eval, progress bar, checkpoint
        if stopping(run, stop):
            save_and_exit(run, stop)
    return finish(run)


@dataclass
class Run:
    """What the loop works on, in one place. ``state`` holds the counters and everything else a
    checkpoint needs besides the weights, the optimizer, the buffer and the RNG streams (JSON)."""
    cfg: Config
    task: object                    # tasks.Task
    model: object                   # the PEFT model
    tokenizer: object
    optimizer: torch.optim.Optimizer
    buffer: object                  # buffer.ReplayBuffer: this process's shard
    rng: random.Random              # the prompt stream (the same on every rank)
    out: str                        # the run folder
    state: dict
    rank: int = 0
    world: int = 1
    stop_signum: int | None = None
    metrics_file: object = None
    bar: object = None
    board: object = None            # TensorBoard writer, with --report-to tensorboard
    fast: object = None             # rollout.FastDecoding, with --fast-generation

    @property
    def say(self):
        return print if self.cfg.progress and self.rank == 0 else (lambda *args, **kwargs: None)


COUNTERS = ("step", "round", "gen_tokens", "gen_seconds", "train_seconds", "skipped_steps", "reward_errors",
            "idle_rounds", "lapsed_updates")


def setup(cfg: Config, task) -> Run:
    """Load the policy, build the optimizer and the buffer, start or resume the run folder."""
    import demo
    from buffer import ReplayBuffer
    from replay_rl import load_policy

    device = pick_device(cfg.device)
    rank, W = init_distributed(device), world_size()
    if W > 1 and device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    out = [cfg.output_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))]
    if W > 1:       # rank 0's folder name (the ranks' clocks may straddle a second)
        torch.distributed.broadcast_object_list(out, src=0)
    out = out[0]
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**dataclasses.asdict(cfg), "world_size": W}, f, indent=2)
    model_path = cfg.model
    if cfg.model == "tiny":                       # built once (rank 0), then loaded from the cache
        if rank == 0:
            model_path = demo.tiny_model(task, cfg.warm_start_steps, seed=cfg.warm_start_seed)
        barrier()
        model_path = demo.tiny_model(task, cfg.warm_start_steps, seed=cfg.warm_start_seed)
    torch.manual_seed(cfg.seed + rank)            # after the warm start, which may have used the RNG
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
    params = [p for p in model.parameters() if p.requires_grad]
    if W > 1:       # every rank starts from rank 0's adapter (the LoRA init is random), as DDP does
        for p in params:
            torch.distributed.broadcast(p.data, src=0)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    buffer = ReplayBuffer(cfg.buffer_size // W, max_age=cfg.max_age or None, seed=cfg.seed + rank,
                          keep_correct_frac=cfg.keep_correct_frac, skip_zero_advantage=cfg.skip_zero_advantage)
    R, N, B, K = cfg.rollouts_per_round, cfg.buffer_size, cfg.batch_size, cfg.updates_per_round
    state = {"step": 0, "round": 0, "gen_tokens": 0, "gen_seconds": 0.0, "train_seconds": 0.0,
             "skipped_steps": 0, "skipped_in_a_row": 0, "reward_errors": 0, "eval_reward_errors": 0,
             "pending_updates": 0, "round_batch_size": B, "lapsed_updates": 0, "rollouts_trained": 0,
             "round_stats": {}, "first_accuracy": None, "last_accuracy": None, "last_eval_round": -1,
             "next_eval_tokens": cfg.eval_every_tokens, "idle_rounds": 0, "metrics_bytes": 0, "world_size": W}
    run = Run(cfg, task, model, tokenizer, optimizer, buffer, random.Random(cfg.seed), out, state, rank, W)

    say = run.say
    n_total = sum(p.numel() for p in model.parameters())
    say(f"model {model_path} on {device} ({str(dtype).replace('torch.', '')}"
        f"{', 4-bit' if cfg.load_in_4bit else ''}): {n_total / 1e6:.2f}M parameters, "
        f"{sum(p.numel() for p in params) / 1e6:.3f}M trainable (LoRA r={cfg.lora_r})")
    say(f"task {task.name}: {len(task.train_prompts)} training prompts, "
        f"{min(cfg.eval_prompts, len(task.eval_prompts))} held-out eval prompts")
    say(f"round: R={R} new rollouts ({cfg.prompts_per_round} prompts x {cfg.num_generations}); "
        f"K={K} updates of B={B} from a buffer of N={N}" + (f"; {W} processes, each 1/{W} of R, N and B" if W > 1
                                                           else ""))
    say(f"replay ratio K*B/R = {K * B / R:.2f} uses per rollout; staleness horizon N/R = {N / R:.1f} rounds; "
        f"loss {cfg.loss} (is_cap {cfg.is_cap}), lr {cfg.lr}" + ("" if cfg.reuse else "; each rollout used once"))
    if cfg.fast_generation:
        from rollout import FastDecoding
        # sized once for the longest training prompt: a cache that grows later means a recompile
        longest = max(map(len, tokenizer(task.train_prompts, add_special_tokens=False).input_ids))
        run.fast = FastDecoding(model, max_length=longest + (cfg.max_new_tokens or task.max_new_tokens))
        if cfg.load_in_4bit or torch.device(device).type != "cuda":
            say("--fast-generation: generation stays eager here (transformers compiles the decode step on a GPU, "
                "not on a CPU and not for 4-bit models); the static cache alone is slower than plain generate")
    if K * B > R and cfg.reuse:
        say("this is experience replay: each rollout is used about K*B/R times, the rollout ages and the "
            "importance ratios in the metrics show how stale the replayed data is")

    metrics_path = os.path.join(out, "metrics.jsonl")
    if cfg.resume:
        run.state, saved_cfg = load_checkpoint(cfg.resume, run)
        resumed = run.state
        resumed.setdefault("round_batch_size", saved_cfg["batch_size"])     # checkpoints from before these fields
        for key in ("lapsed_updates", "eval_reward_errors"):
            resumed.setdefault(key, 0)
        resumed.setdefault("rollouts_trained", resumed["step"] * saved_cfg["batch_size"])
        rounds = all_ranks([resumed["round"]], "min") + all_ranks([resumed["round"]], "max")
        if rounds[0] != rounds[1]:
            sys.exit(f"error: the processes resumed from different checkpoints (rounds {rounds[0]:.0f} and "
                     f"{rounds[1]:.0f}); resume with --resume {out}/checkpoint-<round>")
        for group in optimizer.param_groups:        # the optimizer state brought the old lr back
            group["lr"] = cfg.lr
        if rank == 0:
            with open(metrics_path, "a") as f:      # drop lines written after the checkpoint
                f.truncate(resumed["metrics_bytes"])
            for r in checkpoint_rounds(out):        # and later checkpoints: that timeline is abandoned
                if r > resumed["round"]:
                    shutil.rmtree(os.path.join(out, f"checkpoint-{r}"))
        say(f"resumed from {cfg.resume}: round {resumed['round']}, step {resumed['step']}")
        if resumed["pending_updates"] and (resumed["round_batch_size"] != B or saved_cfg["updates_per_round"] != K):
            # The interrupted round's updates were decided with the saved B and K: they finish as decided.
            say(f"the interrupted round finishes its {resumed['pending_updates']} remaining update(s) with the saved "
                f"B={resumed['round_batch_size']}; --batch-size {B} / --updates-per-round {K} apply from round "
                f"{resumed['round'] + 1}")
    if rank == 0:
        run.metrics_file = open(metrics_path, "a" if cfg.resume else "w")
        if cfg.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            run.board = SummaryWriter(log_dir=out, purge_step=run.state["step"] + 1 if cfg.resume else None)
        if cfg.plot and importlib.util.find_spec("matplotlib") is None:
            say("matplotlib is not installed: no curves.png (pip install matplotlib; or python plot.py RUN later)")
    from tqdm import tqdm
    run.bar = tqdm(total=cfg.max_rounds, initial=run.state["round"], desc="rounds", dynamic_ncols=True,
                   disable=not cfg.progress or rank != 0)
    return run


def generate_round(run: Run) -> None:
    """A new round: R rollouts from the current policy into the buffer; decides the round's updates."""
    from rollout import generate_rollouts

    cfg, state, model = run.cfg, run.state, run.model
    state["round"] += 1
    # Every rank draws the same prompts and takes its share: a prompt's G samples stay on one rank.
    prompts = run.rng.sample(run.task.train_prompts, cfg.prompts_per_round)[run.rank::run.world]
    on_gpu = next(model.parameters()).is_cuda
    t0 = time.perf_counter()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    model.eval()
    errors_before = state["reward_errors"]
    rollouts, gen = generate_rollouts(model, run.tokenizer, prompts, lambda p, c: score(run, p, c),
                                      num_generations=cfg.num_generations,
                                      max_new_tokens=cfg.max_new_tokens or run.task.max_new_tokens,
                                      temperature=cfg.temperature, top_p=cfg.top_p, policy_version=state["step"],
                                      fast=run.fast)
    model.train()
    state["gen_seconds"] += time.perf_counter() - t0
    # the round's figures over all ranks (each generated R/W rollouts from P/W prompts)
    n, groups, tokens = len(rollouts), len(prompts), gen["new_tokens"]
    sums = all_ranks([gen["reward"] * n, gen["zero_adv_frac"] * groups, gen["rollout_entropy"] * tokens,
                      gen["completion_len"] * n, gen["truncated_frac"] * n, tokens, n, groups,
                      state["reward_errors"] - errors_before])
    state["gen_tokens"] += int(sums[5])
    state["reward_errors"] = errors_before + int(sums[8])
    state["round_stats"] = {"reward": sums[0] / sums[6], "zero_adv_frac": sums[1] / sums[7],
                            "rollout_entropy": sums[2] / max(sums[5], 1), "completion_len": sums[3] / sums[6],
                            "truncated_frac": sums[4] / sums[6]}
    if on_gpu:      # what generation needs: allocated by tensors, and reserved by the allocator
        state["round_stats"].update(gen_peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30,
                                    gen_reserved_gb=torch.cuda.max_memory_reserved() / 2**30)
        torch.cuda.reset_peak_memory_stats()
    run.buffer.add(rollouts)
    run.buffer.drop_stale(state["step"])
    # Until every shard holds its share of B: generate only.
    full = all_ranks([float(len(run.buffer) >= cfg.batch_size // run.world)], "min")[0]
    state["pending_updates"] = cfg.updates_per_round if full else 0
    state["round_batch_size"] = cfg.batch_size
    state["idle_rounds"] += not state["pending_updates"]


def update(run: Run) -> None:
    """One optimizer step on B rollouts sampled from the buffer (B/W from each rank's shard)."""
    from replay_rl import update_step

    cfg, state = run.cfg, run.state
    local_batch = state["round_batch_size"] // run.world
    run.buffer.drop_stale(state["step"])            # --max-age holds at every update, not only once a round
    if not all_ranks([float(len(run.buffer) >= local_batch)], "min")[0]:
        state["lapsed_updates"] += state["pending_updates"]     # too few unused / young enough: the rest lapse
        state["pending_updates"] = 0
        return
    t0 = time.perf_counter()
    batch = run.buffer.sample(local_batch, remove=not cfg.reuse)
    m = update_step(run.model, run.optimizer, batch, pad_id=run.tokenizer.pad_token_id, policy_version=state["step"],
                    loss_type=cfg.loss, is_cap=cfg.is_cap, epsilon=cfg.epsilon, normalization=cfg.normalization,
                    temperature=cfg.temperature, beta=cfg.beta, asymre_tau=cfg.asymre_tau,
                    micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm)
    stats = state["round_stats"]
    if next(run.model.parameters()).is_cuda:        # peak GPU memory of training (since generation), and of the round
        stats["train_peak_mem_gb"] = max(stats.get("train_peak_mem_gb", 0.0), torch.cuda.max_memory_allocated() / 2**30)
        stats["train_reserved_gb"] = max(stats.get("train_reserved_gb", 0.0), torch.cuda.max_memory_reserved() / 2**30)
        stats["peak_mem_gb"] = max(stats.get("gen_peak_mem_gb", 0.0), stats["train_peak_mem_gb"])
    state["step"] += 1
    state["rollouts_trained"] += len(batch) * run.world
    state["pending_updates"] -= 1
    state["train_seconds"] += time.perf_counter() - t0
    state["skipped_steps"] += m["skipped"]
    state["skipped_in_a_row"] = state["skipped_in_a_row"] + 1 if m["skipped"] else 0
    log(run, {**m, **stats, "batch_size": len(batch) * run.world, "buffer_size": int(all_ranks([len(run.buffer)])[0]),
              "lr": run.optimizer.param_groups[0]["lr"]})
    if state["skipped_in_a_row"] >= cfg.max_skipped_steps:
        sys.exit(f"error: {state['skipped_in_a_row']} steps in a row had a NaN/inf loss or gradient "
                 f"(skipped, weights unchanged); lower --lr or check the reward. Last checkpoint: "
                 f"{find_checkpoint(run.out) or 'none'}")


def score(run: Run, prompt: str, completion: str, counter: str = "reward_errors") -> float:
    """The task's reward, checked: a finite float, or (--on-reward-error zero) 0 with the error counted."""
    try:
        value = float(run.task.reward(prompt, completion))
        if not math.isfinite(value):
            raise ValueError(f"non-finite reward {value}")
        return value
    except Exception as e:
        if run.cfg.on_reward_error == "zero":
            run.state[counter] += 1
            return 0.0
        raise RewardError(f"the reward function failed on prompt {prompt!r} with completion {completion!r}: "
                          f"{type(e).__name__}: {e} (--on-reward-error zero scores such cases 0)") from e


def evaluate(run: Run) -> float:
    """Greedy accuracy on the held-out prompts (each rank scores its share); logged as an eval line."""
    from rollout import greedy_rewards

    state, task = run.state, run.task
    prompts = task.eval_prompts[:run.cfg.eval_prompts]
    mine = prompts[run.rank::run.world]
    run.model.eval()
    errors_before = state["eval_reward_errors"]
    # eval_accuracy: the training reward; plus the task's own (GSM8K: eval_strict, eval_lenient)
    fns = {"eval_accuracy": lambda p, c: score(run, p, c, "eval_reward_errors"),
           **{f"eval_{k}": f for k, f in task.eval_rewards.items()}}
    means = greedy_rewards(run.model, run.tokenizer, mine, fns, max_new_tokens=run.cfg.max_new_tokens
                           or task.max_new_tokens) if mine else dict.fromkeys(fns, 0.0)
    run.model.train()
    totals = all_ranks([means[k] * len(mine) for k in fns] + [state["eval_reward_errors"] - errors_before])
    scores = {k: t / len(prompts) for k, t in zip(fns, totals)}
    state["eval_reward_errors"] = errors_before + int(totals[-1])
    log(run, {**scores, "eval_reward_errors": state["eval_reward_errors"]})
    acc = scores["eval_accuracy"]
    state["last_accuracy"], state["last_eval_round"] = acc, state["round"]
    if state["first_accuracy"] is None:
        state["first_accuracy"] = acc
    if run.rank == 0 and run.cfg.plot:
        try:
            draw_curves(run)
        except Exception as e:          # a figure is not worth a run (a full disk, a matplotlib quirk)
            print(f"warning: curves.png not drawn ({type(e).__name__}: {e})", file=sys.stderr)
    return acc


def log(run: Run, row: dict) -> None:
    """One line of metrics.jsonl (and TensorBoard scalars), written by rank 0."""
    if run.rank != 0:
        return
    row = {**{k: run.state[k] for k in COUNTERS}, **row}
    run.metrics_file.write(json.dumps(row) + "\n")
    run.metrics_file.flush()
    run.state["metrics_bytes"] = run.metrics_file.tell()
    if run.board is not None:
        for key, value in row.items():
            if isinstance(value, (int, float)) and key != "step":
                run.board.add_scalar(("eval/" if key.startswith("eval_") else "train/") + key, value, row["step"])


def draw_curves(run: Run) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        return
    import plot
    run.metrics_file.flush()
    plot.plot_run(run.out)


def end_of_round(run: Run) -> None:
    """Eval when due, the progress bar, a checkpoint when due."""
    cfg, state = run.cfg, run.state
    if cfg.eval_every_tokens:                       # at fixed token counts: curves of runs line up
        if state["gen_tokens"] >= state["next_eval_tokens"]:
            state["next_eval_tokens"] = (state["gen_tokens"] // cfg.eval_every_tokens + 1) * cfg.eval_every_tokens
            evaluate(run)
    elif state["round"] % cfg.eval_every == 0:
        evaluate(run)
    stats = state["round_stats"]
    run.bar.update(state["round"] - run.bar.n)
    run.bar.set_postfix(reward=f"{stats.get('reward', 0):.2f}", acc=f"{state['last_accuracy']:.3f}",
                        step=state["step"], tokens=state["gen_tokens"],
                        **({"mem": f"{stats['peak_mem_gb']:.1f}G"} if "peak_mem_gb" in stats else {}))
    if cfg.save_every and state["round"] % cfg.save_every == 0:
        save_checkpoint(run)


def budget_spent(run: Run) -> bool:
    state, cfg = run.state, run.cfg
    return state["round"] >= cfg.max_rounds or 0 < cfg.max_gen_tokens <= state["gen_tokens"]


def stopping(run: Run, stop: StopRequest) -> bool:
    """Whether a Ctrl-C / SIGTERM asked to stop; with several processes, whether any rank was asked
    (all of them stop at the same step, or the others would wait for it forever)."""
    if run.stop_signum is None:
        signum = all_ranks([float(stop.signum or 0)], "max")[0]
        run.stop_signum = int(signum) or None
    return run.stop_signum is not None


def save_and_exit(run: Run, stop: StopRequest) -> None:
    run.bar.close()
    path = save_checkpoint(run)
    if run.rank == 0:
        print(f"interrupted: checkpoint saved to {path}\nresume with: python train.py --resume {run.out}",
              file=sys.stderr)
        run.metrics_file.close()
    sys.exit(128 + run.stop_signum)


def finish(run: Run) -> dict:
    """The last eval and checkpoint, the adapter, and the end-of-run summary."""
    cfg, state = run.cfg, run.state
    run.bar.close()
    if state["last_eval_round"] != state["round"]:
        evaluate(run)
    save_checkpoint(run)
    if run.rank == 0:
        run.metrics_file.close()
        if run.board is not None:
            run.board.close()
        run.model.save_pretrained(os.path.join(run.out, "adapter"))
    summarize(run)
    return {"first_accuracy": state["first_accuracy"], "final_accuracy": state["last_accuracy"],
            "output_dir": run.out, **state}


def summarize(run: Run) -> None:
    cfg, state, say = run.cfg, run.state, run.say
    first, last = state["first_accuracy"], state["last_accuracy"]
    total = state["gen_seconds"] + state["train_seconds"]
    say(f"eval accuracy: {first:.3f} at step 0 -> {last:.3f} after {state['step']} steps ({last - first:+.3f})")
    say(f"generated {state['gen_tokens']} completion tokens in {state['round']} rounds; time generation "
        f"{state['gen_seconds']:.1f} s / training {state['train_seconds']:.1f} s "
        f"({100 * state['gen_seconds'] / max(total, 1e-9):.0f}% generating)")
    generated, trained = state["round"] * cfg.rollouts_per_round, state["rollouts_trained"]
    if generated and trained and state["train_seconds"] > 0:
        mu = (state["gen_seconds"] / generated) / (state["train_seconds"] / trained)
        say(f"measured mu = {mu:.2f}: seconds to generate one rollout / to train on one (on a GPU, 8-27)")
        if trained > generated:
            # An on-policy run (R = B, K = 1) with as many updates would generate one rollout per one trained.
            on_policy_tokens = state["gen_tokens"] * trained / generated
            say(f"replay: each rollout was used {trained / generated:.2f} times; an on-policy run with as many "
                f"updates would have generated ~{on_policy_tokens:,.0f} tokens: this run saved "
                f"~{on_policy_tokens - state['gen_tokens']:,.0f} ({1 - generated / trained:.0%} of generation)")
    if state["skipped_steps"] or state["reward_errors"]:
        say(f"skipped steps (NaN/inf): {state['skipped_steps']}; reward errors scored 0: {state['reward_errors']}")
    if state["eval_reward_errors"]:
        say(f"reward errors scored 0 during evals: {state['eval_reward_errors']}")
    if state["idle_rounds"]:
        say(f"rounds without an update (the buffer held fewer than B={cfg.batch_size} rollouts): "
            f"{state['idle_rounds']}")
    if state["lapsed_updates"]:
        say(f"updates skipped because fewer than B rollouts were left (each used once with --no-reuse, or "
            f"older than --max-age): {state['lapsed_updates']}")
    say(f"run folder: {run.out} (metrics.jsonl, adapter/, checkpoint-{state['round']}/"
        f"{', curves.png' if cfg.plot and importlib.util.find_spec('matplotlib') else ''})")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("\ninterrupted again: exited at once, without saving")
