"""train.py's command line: one flag per Config field, the rules a config must keep, --resume.
(What --task and --model name is loaded by loading.py.)

The flags are checked before any model is loaded; a config that breaks a rule stops with one line
on stderr naming the flag, the value and the rule (exit code 2). With --resume the checkpoint's
config is the base and the flags given on the command line override it, except the fields the
checkpoint depends on (RESUME_FIXED).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os

from infra import checkpoint
from infra import distributed
from infra import pretrained
from infra import report
from infra import runfolder
import tasks
from buffer import zero_advantage_filter_fits
from replay_rl import MIN_TEMPERATURE     # below it the loss is 0 (sampling is greedy in effect)

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
# 4 prompts x 4 sampled at temperature 0.7; only groups with a reward spread are stored (the others
# have advantage 0: no gradient, but under token_mean they count in the denominator, so leaving them
# out also makes each step larger), in a buffer of 32, and each update takes 16 of them (replay);
# the task's 40 rounds, evals of 100 prompts every 10; log mu recorded while sampling
# (--record-log-mu), as its documented runs were made, and since a forward after generate over
# a 49k vocabulary costs a third of an update here. On 2 cores: +0.35 to +0.42 at round 40 in
# 11.5-14 min, one seed of three down to +0.07 at round 30 (docs/usage.md). A step of B = 256 (the
# demo's) would take minutes there. python train.py --model smollm2 --help shows these.
MODEL_DEFAULTS = {"smollm2": dict(task="sums", prompts_per_round=4, num_generations=4, temperature=0.7,
                                  skip_zero_advantage=True, batch_size=16, buffer_size=32, lr=2.5e-4,
                                  eval_prompts=100, eval_every=10, record_log_mu=True)}


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        # one line, no usage dump, no traceback; printed once (rank 0), though every rank exits
        self.exit(2, f"{self.prog}: error: {message}\n" if distributed.is_main() else None)


def build_parser(config_class, description: str = "", explicit_only: bool = False,
                 model: str | None = None):
    """The CLI, one flag per field of the config dataclass (its help: the field's metadata).
    explicit_only: flags not given are left out of the result. model: the --model given, whose
    own defaults (MODEL_DEFAULTS) the help shows; parse applies them, the parser does not."""
    shown = MODEL_DEFAULTS.get(model, {})
    parser = OneLineParser(description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           argument_default=argparse.SUPPRESS if explicit_only else None)
    for f in dataclasses.fields(config_class):
        flag = "--" + f.name.replace("_", "-")
        default = argparse.SUPPRESS if explicit_only else f.default
        own = f" ({model}'s default: {shown[f.name]})" if f.name in shown else ""
        if isinstance(f.default, bool):
            on_off = f" (default: {'on' if f.default else 'off'})"
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f.metadata["help"] + (own or on_off))
        else:
            # a field with choices shows them ({tis,ppo,asymre}); the others their type (INT)
            extra = ({"choices": f.metadata["choices"]} if "choices" in f.metadata
                     else {"metavar": type(f.default).__name__.upper()})
            parser.add_argument(flag, type=type(f.default), default=default,
                                help=f.metadata["help"] + (own or " (default: %(default)s)"),
                                **extra)
    return parser


def parse(config_class, argv=None, description: str = ""):
    """Flags -> (config, the checkpoint to resume from or None), checked before anything is
    loaded. The checkpoint is read here, once: its files reading back is what makes it one to
    resume from (the newest such one of a run folder)."""
    model = OneLineParser(add_help=False)               # --model first: --help shows its defaults
    model.add_argument("--model")
    parser = build_parser(config_class, description, model=model.parse_known_args(argv)[0].model)
    cfg = config_class(**vars(parser.parse_args(argv)))
    # absolute from the start: a reward that changes the working directory moves nothing
    cfg = dataclasses.replace(cfg, **{name: os.path.abspath(getattr(cfg, name))
                                      for name in ("output_dir", "resume") if getattr(cfg, name)})
    if not cfg.resume and cfg.model in MODEL_DEFAULTS:     # the flags not given: the model's own
        given = vars(build_parser(config_class, explicit_only=True).parse_args(argv))
        defaults = {k: v for k, v in MODEL_DEFAULTS[cfg.model].items() if k not in given}
        # asymre and the KL term train on all-equal groups too: no filter for them
        if not zero_advantage_filter_fits(cfg.loss, cfg.beta):
            defaults.pop("skip_zero_advantage", None)
        cfg = dataclasses.replace(cfg, **defaults)
    saved = None
    if cfg.resume and (config := unsaved_run(cfg.resume)) is not None:
        # a run stopped before its first checkpoint: it starts again, in its folder, from its config
        given = vars(build_parser(config_class, explicit_only=True).parse_args(argv))
        fields = {f.name for f in dataclasses.fields(config_class)}
        if changed := fixed_changes(config_class, config, given):
            parser.error(f"--resume {cfg.resume}: these fields cannot change on resume: "
                         f"{', '.join(changed)}")
        distributed.print0(f"{cfg.resume} holds no checkpoint yet: the run starts again from its "
                           "config.json")
        cfg = config_class(**{**{k: v for k, v in config.items() if k in fields}, **given,
                              "resume": "", "output_dir": cfg.resume})
    elif cfg.resume:
        saved = resume_point(cfg.resume, parser, config_class)
        config = saved.config
        if problem := stale_demo(config):
            parser.error(f"--resume {saved.path}: {problem}")
        saved_world = saved.state["world_size"]
        if saved_world != distributed.world_size():
            parser.error(f"--resume {saved.path}: saved by {saved_world} process(es), resumed with "
                         f"{distributed.world_size()}: each process holds its own buffer shard; "
                         f"resume with {saved_world}")
        given = vars(build_parser(config_class, explicit_only=True).parse_args(argv))
        saved_value = fixed_values(config_class, config)
        if changed := fixed_changes(config_class, config, given):
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
    elif cfg.output_dir and runfolder.holds_run(cfg.output_dir):
        parser.error(f"--output-dir {cfg.output_dir}: it holds a run; continue it with --resume "
                     f"{cfg.output_dir}, or give another --output-dir")
    problem = config_problem(cfg) or async_problem(cfg)
    if problem:
        parser.error(problem)       # one line, exit code 2, before any model is loaded
    return cfg, saved


def fixed_values(config_class, config: dict) -> dict:
    """A saved run's RESUME_FIXED fields (a field newer than its config: saved with the default)."""
    return {k: config.get(k, getattr(config_class, k)) for k in RESUME_FIXED}


def fixed_changes(config_class, config: dict, given: dict) -> list[str]:
    """The RESUME_FIXED flags given with another value than the saved config's (by the model they
    name: canonical), as '--flag (saved X, given Y)'."""
    saved = fixed_values(config_class, config)
    return [f"--{k.replace('_', '-')} (saved {saved[k]!r}, given {given[k]!r})" for k in RESUME_FIXED
            if k in given and canonical(k, given[k], config["task"]) != canonical(k, saved[k], config["task"])]


def canonical(field: str, value, task: str):
    """A RESUME_FIXED value as the model it names: --warm-start-steps 0 is the task's own length
    (demo_model.WARM_START: 2000; demo_model.WARM_STARTS: columns 800), so 0 and 2000 build the same model."""
    if field == "warm_start_steps":
        from infra import demo_model
        return value or demo_model.WARM_STARTS.get(task, demo_model.WARM_START)["steps"]
    return value


def stale_demo(config: dict) -> str | None:
    """Why a saved run of the demo model cannot go on, or None: before 2026-11-30 the demo model had
    a one-phase warm start, which is no longer built (its runs saved no warm_start_seed)."""
    if config.get("model") == "tiny" and "warm_start_seed" not in config:
        return ("trained on the demo model's earlier one-phase warm start, which this code no "
                "longer builds: its adapter would sit on another base model; start a new run")
    return None


def unsaved_run(path: str) -> dict | None:
    """The config of a run folder that holds a run's config.json but no checkpoint (stopped before
    its first one was saved), or None: --resume starts such a run again."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config) or checkpoint.find(path) is not None:
        return None
    try:
        with open(config) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def resume_point(path: str, parser, config_class) -> checkpoint.Checkpoint:
    """The checkpoint --resume names, or the newest of a run folder that reads back and whose
    contents pass (checkpoint.read: the buffer, the loop state; here also the config's types and
    the token ids against the model's vocabulary, where it can be read without loading the
    model). None intact: one line with the way forward (checkpoint.no_intact_checkpoint)."""
    def check(saved):
        return (saved_config_problem(config_class, saved.config)
                or checkpoint.tokens_problem(saved.buffer, vocab_size(
                    saved.config.get("model"), saved.config.get("trust_remote_code", False))))

    found = checkpoint.find(path)
    if found is None:
        parser.error(f"--resume {path}: no checkpoint there (a checkpoint-<round> folder with "
                     "state.json)")
    if problem := later_checkpoints(found):
        parser.error(f"--resume {found}: {problem}")
    try:
        if found != path.rstrip("/"):                   # a run folder
            saved = checkpoint.newest_readable(path, check)
            if saved is None:
                parser.error(f"--resume {path}: {checkpoint.no_intact_checkpoint(path)}")
            return saved
        return checkpoint.read(found, check)
    except checkpoint.NewerVersion as e:
        parser.error(f"--resume: {e}")
    except checkpoint.Damaged as e:
        parser.error(f"--resume {found}: damaged checkpoint, {e}; --resume "
                     f"{os.path.dirname(found)} takes the newest intact one")


def later_checkpoints(found: str) -> str | None:
    """Why resuming from this checkpoint would leave later ones of its run folder behind, in words
    with the commands that go on, or None (it is the newest). A resume from an older checkpoint
    deletes nothing unasked: the later ones are named, and moving them aside is the user's."""
    import shlex
    run_dir, name = os.path.split(found.rstrip("/"))
    mine = int(name.split("-")[1])
    later = [r for r in checkpoint.rounds(run_dir or ".") if r > mine]
    if not later:
        return None
    names = [os.path.join(run_dir, f"checkpoint-{r}") for r in later]
    aside = os.path.join(run_dir, f"after-round-{mine}")
    move = (f"mkdir {shlex.quote(aside)} && mv {' '.join(map(shlex.quote, names))} "
            f"{shlex.quote(aside)}/")
    return (f"the run went on past it ({', '.join(os.path.basename(n) for n in names)}), and a "
            f"resume from here would go another way beside them; to resume here, move them aside "
            f"first: {move} (metrics.jsonl's later rows are then copied aside too); to go on from "
            f"the newest: --resume {run_dir}")


def saved_config_problem(config_class, config: dict) -> str | None:
    """A saved config's field of another type than the Config's (an int where a float goes is
    fine), as 'state.json (...)', or None."""
    for f in dataclasses.fields(config_class):
        value, kind = config.get(f.name, f.default), type(f.default)
        fits = (isinstance(value, (int, float)) and not isinstance(value, bool)
                if kind is float else type(value) is kind)
        if not fits:
            return f"state.json (the config's {f.name} is {value!r}, not a {kind.__name__})"
    return None


@functools.lru_cache(maxsize=8)
def vocab_size(model: str, trust_remote_code: bool = False) -> int | None:
    """The vocabulary of --model, read without loading the model (its config; the demo model's
    tokenizer), or None where that cannot be done here (not cached, not installed)."""
    try:
        if model == "tiny":
            from infra import demo_model
            return len(demo_model.char_tokenizer())
        from transformers import AutoConfig
        folder = pretrained.resolve(model, log=lambda line: None)   # smollm2, .gguf: converted
        if not os.path.isdir(folder):
            tasks.use_local_cache_if_offline()
        return int(AutoConfig.from_pretrained(folder,
                                              trust_remote_code=trust_remote_code).vocab_size)
    except Exception:                   # checked again once the model is loaded (restore)
        return None


def config_problem(cfg) -> str | None:
    """The first rule the config breaks, as one line naming the field, the value and the rule."""
    for f in dataclasses.fields(cfg):   # NaN passes every comparison below; inf breaks the run
        if isinstance(getattr(cfg, f.name), float) and not math.isfinite(getattr(cfg, f.name)):
            return f"--{f.name.replace('_', '-')} {getattr(cfg, f.name)}: must be a finite number"
    for name in ("prompts_per_round", "num_generations", "buffer_size", "batch_size",
                 "updates_per_round", "eval_every", "eval_prompts", "lora_r", "lr",
                 "temperature", "keep_checkpoints", "max_grad_norm",
                 "lora_alpha", "max_skipped_steps"):
        if getattr(cfg, name) <= 0:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be > 0"
    for name in ("warm_start_steps", "warm_start_seed", "max_new_tokens", "max_rounds", "max_gen_tokens",
                 "max_age", "micro_batch_size", "save_every", "eval_every_tokens", "reward_timeout",
                 "new_per_update", "learning_starts", "max_uses", "worker_timeout"):
        if getattr(cfg, name) < 0:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0"
    if cfg.logp_chunk < -1:
        return (f"--logp-chunk {cfg.logp_chunk}: must be -1 (chunked for a large vocabulary), 0 "
                "(not chunked) or a chunk of tokens")
    if cfg.task not in tasks.TASK_NAMES and not cfg.task.endswith(".jsonl"):
        return (f"--task {cfg.task}: unknown; expected {', '.join(tasks.TASK_NAMES)} or a path to "
                "a .jsonl file")
    if cfg.task.endswith(".jsonl") and not os.path.isfile(cfg.task):
        return f"--task {cfg.task}: no such file"
    if problem := pretrained.gguf_problem(cfg.model):      # smollm2 or a .gguf file: no model loaded yet
        return problem
    W = distributed.world_size()
    for name in ("prompts_per_round", "batch_size", "buffer_size", "new_per_update",
                 "learning_starts"):
        if getattr(cfg, name) % W:
            return (f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be a multiple of the "
                    f"number of processes ({W}): each generates, keeps and samples its share")
    if cfg.report_to != "none" and importlib.util.find_spec(cfg.report_to) is None:
        return (f"--report-to {cfg.report_to}: the {cfg.report_to} package is not installed "
                f"(pip install {cfg.report_to})")
    if cfg.report_to == "wandb" and not wandb_credentials():
        return ("--report-to wandb: not logged in to W&B; run `wandb login` once, or set "
                "WANDB_MODE=offline (and `wandb sync` the run later)")
    if cfg.eval_at_tokens:
        try:
            counts = token_counts(cfg.eval_at_tokens)
        except ValueError:
            counts = []
        if not counts or counts != sorted(set(counts)) or counts[0] <= 0:
            return (f"--eval-at-tokens {cfg.eval_at_tokens}: expected token counts > 0, comma-separated "
                    "and ascending, e.g. 1000,2000,4000")
        if cfg.eval_every_tokens:
            return "--eval-at-tokens with --eval-every-tokens: give one grid of evals"
    if cfg.batch_size > cfg.buffer_size:
        return f"--batch-size {cfg.batch_size}: must be <= --buffer-size {cfg.buffer_size}"
    if cfg.new_per_update > cfg.buffer_size:
        return (f"--new-per-update {cfg.new_per_update}: must be <= --buffer-size {cfg.buffer_size} "
                "(new rollouts would leave the buffer before any update)")
    if cfg.learning_starts > cfg.buffer_size:
        return (f"--learning-starts {cfg.learning_starts}: must be <= --buffer-size "
                f"{cfg.buffer_size} (the buffer could never hold that many)")
    if cfg.buffer_size < cfg.rollouts_per_round and not cfg.new_per_update:
        return (f"--buffer-size {cfg.buffer_size}: must hold at least one round "
                f"(prompts_per_round x num_generations = {cfg.rollouts_per_round}), or with "
                "--new-per-update S the S stored between updates")
    if cfg.num_generations == 1 and cfg.loss != "asymre":
        return (f"--num-generations 1: a group of one has advantage 0, so the {cfg.loss} loss has "
                "no gradient; use 2 or more (asymre, whose coefficient r - (V - tau) is tau "
                "there, can train with 1)")
    if cfg.skip_zero_advantage and not zero_advantage_filter_fits(cfg.loss, cfg.beta):
        return (f"--skip-zero-advantage with --loss {cfg.loss} --beta {cfg.beta:g}: asymre "
                "(coefficient tau) and the KL term train on all-equal groups too, so the filter "
                "would change the objective; use it with tis or ppo and --beta 0")
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
    if not 0 < cfg.epsilon < 1:
        return f"--epsilon {cfg.epsilon}: must be in (0, 1)"
    if cfg.shared_prefix and cfg.gradient_checkpointing:
        return ("--shared-prefix with --gradient-checkpointing: a checkpointed layer runs without "
                "its KV cache in training mode, and the shared prefix is that cache; use one")
    return None


def async_problem(cfg) -> str | None:
    """The first rule of --generators (async_rl.py) the config breaks, as one line, or None."""
    if cfg.sync_every <= 0:
        return f"--sync-every {cfg.sync_every}: must be > 0"
    for name in ("generators", "max_lag"):
        if getattr(cfg, name) < 0:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0"
    if not cfg.generators:
        given = [f for f in ("generator_devices", "lockstep", "max_lag", "step_when_held")
                 if getattr(cfg, f)]
        return (f"--{given[0].replace('_', '-')}: only with --generators 1 or more" if given
                else None)
    if cfg.learning_starts:
        return ("--learning-starts with --generators: the synchronous loop's only (the trainer "
                "steps once B are in)")
    if cfg.keep_correct_frac:
        return (f"--keep-correct-frac {cfg.keep_correct_frac} with --generators: it keeps only the "
                "latest round's rollouts from eviction, and rounds arrive between steps: an "
                "earlier one's unused rollouts would go, where the workers wait for room")
    if problem := devices_problem(cfg):
        return problem
    if distributed.world_size() > 1:
        return ("--generators with torchrun: not supported; run one trainer process "
                "(python train.py --generators W)")
    if cfg.buffer_size < cfg.rollouts_per_round:
        return (f"--buffer-size {cfg.buffer_size}: with --generators every round is stored whole, "
                f"so the buffer must hold one (prompts_per_round x num_generations = "
                f"{cfg.rollouts_per_round})")
    if cfg.step_when_held and (cfg.updates_per_round != 1 or cfg.new_per_update or cfg.lockstep):
        return ("--step-when-held: the trainer steps whenever B are held, so --updates-per-round, "
                "--new-per-update and --lockstep play no part: give none of them")
    if cfg.lockstep and (cfg.sync_every != 1 or cfg.new_per_update):
        return ("--lockstep: K updates after each round, with the weights published after every "
                "step, as the synchronous loop: use it with --sync-every 1 and --new-per-update 0")
    if cfg.max_lag and not cfg.step_when_held:
        return (f"--max-lag {cfg.max_lag} without --step-when-held: a worker would wait for "
                "weights the trainer publishes only after steps that wait for rounds")
    if cfg.max_lag and cfg.max_lag >= cfg.sync_every - 1:
        return (f"--max-lag {cfg.max_lag} with --sync-every {cfg.sync_every}: never waits (the "
                f"published weights are at most {cfg.sync_every - 1} steps behind the trainer); "
                f"a bound of L steps needs --sync-every L + 2 or more")
    return None


def devices_problem(cfg) -> str | None:
    """--generators and --generator-devices against this machine, before anything loads: each
    device one that exists; at most one worker per core on the CPU (each needs a core, and each
    holds its own copy of the model)."""
    import torch

    names = [d.strip() for d in cfg.generator_devices.split(",")] if cfg.generator_devices else []
    for name in names:
        kind, _, index = name.partition(":")
        bad_index = index and (kind != "cuda" or not index.isdigit())
        if kind not in ("cpu", "cuda", "mps") or bad_index:
            return (f"--generator-devices {cfg.generator_devices}: {name!r} is not a device "
                    "(cpu, cuda, cuda:N or mps, comma-separated)")
        if kind == "cuda" and int(index or 0) >= torch.cuda.device_count():
            return (f"--generator-devices {cfg.generator_devices}: {name} is not here "
                    f"({torch.cuda.device_count()} CUDA device(s))")
        if kind == "mps" and not torch.backends.mps.is_available():
            return f"--generator-devices {cfg.generator_devices}: mps is not available here"
    if names:                           # worker i on names[i % len(names)]: counted, not walked
        full, rest = divmod(cfg.generators, len(names))
        on_cpu = full * names.count("cpu") + names[:rest].count("cpu")
    else:
        on_cpu = cfg.generators if distributed.pick_device(cfg.device) == "cpu" else 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if on_cpu > (cores or 1):
        return (f"--generators {cfg.generators}: {on_cpu} workers on the CPU, more than its "
                f"{cores} cores (each worker needs one, and holds a copy of the model)")
    return None


def token_counts(text: str) -> list[int]:
    """--eval-at-tokens' counts: '1000, 2000,4000' -> [1000, 2000, 4000] (ValueError if not ints)."""
    return [int(part) for part in text.split(",")]


def next_eval_tokens(cfg, tokens: int) -> int:
    """The token count of the next eval after ``tokens``: the next of --eval-at-tokens (none left:
    never), else the next multiple of --eval-every-tokens (0 if neither is given)."""
    if cfg.eval_at_tokens:
        return next((t for t in token_counts(cfg.eval_at_tokens) if t > tokens), 2**62)
    every = cfg.eval_every_tokens
    return (tokens // every + 1) * every if every else 0


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
