"""What a run writes and prints: metrics.jsonl, TensorBoard scalars or a Weights & Biases run,
curves.png (drawn by curves.py), the progress bar and the end-of-run summary. Rank 0 writes and
prints; on the other ranks of a torchrun job the same calls do nothing, so the loop calls them on
every rank alike.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import time

import torch

from infra import distributed
from infra import runfolder
from infra.curves import plot_run


# the loop's counters, at the head of every line of metrics.jsonl
COUNTERS = ("step", "round", "gen_tokens", "gen_seconds", "train_seconds", "gen_cpu_seconds",
            "train_cpu_seconds", "eval_seconds", "wall_seconds", "skipped_steps",
            "reward_errors", "idle_rounds", "lapsed_updates", "rollouts_generated", "rollouts_stored",
            "rollouts_trained", "retired_at_cap")


class Report:
    """The run folder's metrics.jsonl (one JSON object a line: a step, or an eval), the same
    figures as TensorBoard scalars (--report-to tensorboard) or in a W&B run (--report-to wandb),
    curves.png and the progress bar.
    cfg: train.Config; state: checkpoint.LoopState, as loaded when resumed: metrics.jsonl is then cut
    back to its length at the checkpoint (later lines belong to an abandoned timeline)."""

    def __init__(self, run_dir: str, cfg, state, resumed: bool):
        from tqdm import tqdm

        self.run_dir, self.metrics, self.board, self.wandb = run_dir, None, None, None
        have_matplotlib = importlib.util.find_spec("matplotlib") is not None
        self.plot = cfg.plot and distributed.is_main() and have_matplotlib
        if distributed.is_main():
            path = os.path.join(run_dir, "metrics.jsonl")
            if resumed and os.path.exists(path) and os.path.getsize(path) >= state.metrics_bytes:
                keep_later_rows(path, state, cfg)
                with open(path, "a") as f:      # cut, never lengthened (cli.py refused a shorter one)
                    f.truncate(state.metrics_bytes)
            self.metrics = open(path, "a" if resumed else "w")
            if cfg.report_to == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                self.board = SummaryWriter(log_dir=run_dir,
                                           purge_step=state.step + 1 if resumed else None)
            if cfg.report_to == "wandb":
                self.wandb = WandbRun(run_dir, cfg, resumed)
            if cfg.plot and not have_matplotlib:
                say(cfg, "matplotlib is not installed: no curves.png (pip install matplotlib; "
                    "or python comparison/plot.py RUN later)")
        self.bar = tqdm(total=cfg.max_rounds, initial=state.round, desc="rounds",
                        dynamic_ncols=True, disable=not cfg.progress or not distributed.is_main())
        self.restart_clock(state)

    def restart_clock(self, state) -> None:
        """The loop's wall clock (state.wall_seconds) runs on from here: from the start of the
        loop, or with --generators from the moment every worker has loaded its model."""
        self.clock = (time.perf_counter(), getattr(state, "wall_seconds", 0.0),
                      getattr(state, "eval_seconds", 0.0))

    def tick(self, state) -> float:
        """state.wall_seconds brought up to now: the loop's wall time, evals excluded (their own
        clock, eval_seconds), so that it counts what the synchronous loop's generation and
        training seconds count, and the loop's bookkeeping besides."""
        if hasattr(state, "wall_seconds"):
            start, wall, evals = self.clock
            state.wall_seconds = wall + time.perf_counter() - start - (state.eval_seconds - evals)
        return getattr(state, "wall_seconds", 0.0)

    def row(self, state, row: dict) -> None:
        """One line of metrics.jsonl, the loop state's COUNTERS then the row (and its numbers as
        TensorBoard scalars at the step, or a W&B step); the file's length into state.metrics_bytes
        (a resume cuts what follows; the other ranks write nothing). state: checkpoint.LoopState."""
        if self.metrics is None:
            return
        runfolder.check_writer(self.run_dir)    # not a process forked from the run
        self.tick(state)
        row = {**{k: getattr(state, k) for k in COUNTERS if hasattr(state, k)}, **row}
        # a full disk: one line (train.py); a resume cuts the partial line off
        with runfolder.full_disk_as_one_line(self.run_dir, self.metrics.name):
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
        if self.board is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    tag = ("eval/" if key.startswith("eval_") else "train/") + key
                    self.board.add_scalar(tag, value, row["step"])
        if self.wandb is not None:
            self.wandb.log(row)
        state.metrics_bytes = self.metrics.tell()

    def curves(self) -> None:
        """Redraw curves.png (with --plot and matplotlib); a failure only warns."""
        if not self.plot:
            return
        try:
            plot_run(self.run_dir)              # (its time: train.evaluate counts it an eval's)
        except Exception as e:      # a figure is not worth a run (a full disk, a matplotlib quirk)
            print(f"warning: curves.png not drawn ({type(e).__name__}: {e})", file=sys.stderr)

    def progress(self, state) -> None:
        """The progress bar at the end of a round: its reward, the latest accuracy, the step, the
        tokens so far, and the round's peak GPU memory where there is one."""
        stats = state.round_stats
        memory = {"mem": f"{stats['peak_mem_gb']:.1f}G"} if "peak_mem_gb" in stats else {}
        self.bar.update(state.round - self.bar.n)
        self.bar.set_postfix(reward=f"{stats.get('reward', 0):.2f}", acc=f"{state.last_accuracy:.3f}",
                             step=state.step, tokens=state.gen_tokens, **memory)

    def close(self) -> None:
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.board is not None:
            self.board.close()
        if self.wandb is not None:
            self.wandb.run.finish()


class WandbRun:
    """--report-to wandb: each line of metrics.jsonl as one W&B step (its line number, from 0, so
    a step line and an eval line never merge), with the same keys, charted against the round; the
    run's config as W&B's config. wandb.json in the run folder keeps the W&B run's id and how many
    lines it holds, so --resume continues the same W&B run: lines it lacks are sent from
    metrics.jsonl, and lines it already holds (rounds re-run after the checkpoint) are not sent
    again: W&B keeps their first values, each line once. Those rounds run again as they ran (exact
    resume) unless the resume changed a flag that changes them (the lr, the batch, ...): then the
    W&B run's lines past the checkpoint belong to an abandoned timeline, and a new W&B run starts
    with the run's kept lines, each once."""

    # flags a resume may change without changing the lines of the rounds it runs again
    SAME_LINES = ("max_rounds", "max_gen_tokens", "save_every", "keep_checkpoints", "progress", "plot",
                  "report_to", "resume", "output_dir", "max_skipped_steps")

    def __init__(self, run_dir: str, cfg, resumed: bool):
        import wandb

        self.path = os.path.join(run_dir, "wandb.json")
        saved = {}
        if resumed and os.path.exists(self.path):
            with open(self.path) as f:
                saved = json.load(f)
        config = {**dataclasses.asdict(cfg), "world_size": distributed.world_size()}
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:     # as cut back to the checkpoint
            kept = [json.loads(line) for line in f]
        changed = sorted(k for k, v in saved.get("config", {}).items()
                         if k not in self.SAME_LINES and config.get(k) != v)
        if saved.get("lines", 0) > len(kept) and changed:
            say(cfg, f"W&B run {saved['id']} holds rounds past the checkpoint run with other "
                f"--{', --'.join(k.replace('_', '-') for k in changed)}: a new W&B run takes this timeline")
            saved = {}
        self.held = saved.get("lines", 0)           # lines of metrics.jsonl the W&B run holds
        self.config = config
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "replay-rl"),
                                  name=os.path.basename(os.path.abspath(run_dir)), id=saved.get("id"),
                                  resume="allow", dir=os.environ.get("WANDB_DIR", run_dir),
                                  settings=wandb.Settings(console="off"))
        except Exception as e:      # no login, no network, a bad WANDB_* setting: one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            distributed.exit_all(f"error: --report-to wandb: W&B did not start ({first}); try "
                                 "`wandb login`, or WANDB_MODE=offline (then `wandb sync` later)")
        self.run.config.update(config, allow_val_change=True)      # may change with --resume
        self.run.define_metric("round")
        self.run.define_metric("*", step_metric="round")
        self.line = self.held
        for row in kept[self.held:]:                # written while not reporting to this W&B run
            self.log(row)
        self.line = len(kept)
        if self.held > self.line:
            say(cfg, f"W&B run {self.run.id}: lines {self.line}-{self.held - 1} of metrics.jsonl "
                "(rounds re-run after the checkpoint) keep there the values of their first run")

    def log(self, row: dict) -> None:
        """One line of metrics.jsonl as a W&B step: its numbers (a list, left_by_uses, stays in the file)."""
        if self.line >= self.held:
            self.run.log({k: v for k, v in row.items() if not isinstance(v, list)}, step=self.line)
            self.held = self.line + 1
            runfolder.write_json(self.path, {"id": self.run.id, "lines": self.held, "config": self.config})
        self.line += 1


def keep_later_rows(path: str, state, cfg) -> None:
    """Before a resume cuts metrics.jsonl back to its checkpoint: rows of rounds after the one the
    resume does again (a resume from an older checkpoint) are copied aside first, into
    metrics-after-round-<round>.jsonl beside it, and said so; the rows of the round a stop cut
    short go, as that round is done again."""
    with open(path, "rb") as f:
        f.seek(state.metrics_bytes)
        tail = f.read()
    rounds = []
    for line in tail.splitlines():
        with contextlib.suppress(ValueError, AttributeError):
            rounds.append(int(json.loads(line).get("round", 0)))
    if not rounds or max(rounds) <= state.round + 1:
        return
    aside = os.path.join(os.path.dirname(path), f"metrics-after-round-{state.round}.jsonl")
    n = 2
    while os.path.exists(aside):
        aside = os.path.join(os.path.dirname(path), f"metrics-after-round-{state.round}-{n}.jsonl")
        n += 1
    with open(aside, "wb") as f:
        f.write(tail)
    distributed.print0(f"metrics.jsonl: its {len(rounds)} rows after round {state.round} (to round "
                       f"{max(rounds)}) are copied to {aside}, then cut: this run goes on from "
                       f"round {state.round}", file=sys.stderr)


def metrics_problem(run_dir: str, length: int, round: int) -> str | None:
    """Why a resume cannot cut run_dir/metrics.jsonl back to its checkpoint's ``length`` bytes, or
    None: the file is shorter (cut or replaced since), or that length is not the end of a line
    (changed since). A missing file is fine: a new one starts after the checkpoint."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    size = os.path.getsize(path)
    if size < length:
        what = f"holds {size:,} bytes, fewer than the {length:,} it had at the checkpoint of round {round}"
    elif length:
        with open(path, "rb") as f:
            f.seek(length - 1)
            if f.read(1) == b"\n":
                return None
        what = f"was changed since the checkpoint of round {round} (its byte {length:,} ends no line)"
    else:
        return None
    return (f"{path} {what}: put back the file as it was, or move it away to go on with a new "
            "metrics.jsonl from the checkpoint on")


@contextlib.contextmanager
def timed(state, phase: str):
    """The block's wall and CPU seconds added to state.<phase>_seconds and <phase>_cpu_seconds
    (CPU: this process's; runs side by side stretch its wall time more than its CPU time)."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    setattr(state, f"{phase}_seconds", getattr(state, f"{phase}_seconds") + time.perf_counter() - wall)
    setattr(state, f"{phase}_cpu_seconds", getattr(state, f"{phase}_cpu_seconds") + time.process_time() - cpu)


def count_round(state, gen: dict, rollouts: int, prompts: int, reward_errors: int, stored: int) -> None:
    """A round's figures over all processes into the loop state: its means (weighted by rollouts,
    prompts or tokens) as round_stats, and the counts of tokens, reward errors, rollouts generated
    and stored. gen: rollout.generate_rollouts' figures of this process's share."""
    tokens = gen["new_tokens"]
    state.round_stats = distributed.means({
        "reward": (gen["reward"], rollouts), "zero_adv_frac": (gen["zero_adv_frac"], prompts),
        "rollout_entropy": (gen["rollout_entropy"], tokens),
        "completion_len": (gen["completion_len"], rollouts),
        "truncated_frac": (gen["truncated_frac"], rollouts)})
    total = distributed.sums({"tokens": tokens, "reward_errors": reward_errors, "generated": rollouts,
                              "stored": stored})
    state.gen_tokens += int(total["tokens"])
    state.reward_errors += int(total["reward_errors"])
    state.rollouts_generated += int(total["generated"])
    state.rollouts_stored += int(total["stored"])
    state.round_stats["stored_frac"] = total["stored"] / max(total["generated"], 1)


def count_step(state, figures: dict, batch_size: int) -> None:
    """A step's counts into the loop state: rollouts trained on, skipped steps, the ages trained at."""
    state.rollouts_trained += batch_size
    state.skipped_steps += figures["skipped"]
    state.skipped_in_a_row = state.skipped_in_a_row + 1 if figures["skipped"] else 0
    state.age_sum += figures["age_mean"] * batch_size
    state.age_max = max(state.age_max, int(figures["age_max"]))


def count_eval(state, means: dict, prompts: int, reward_errors: int) -> dict:
    """An eval's scores over all processes (means: this process's, over its ``prompts``), the
    reward errors it met, and the accuracy at step 0 and at the latest eval, into the loop state."""
    scores = distributed.means({k: (v, prompts) for k, v in means.items()})
    state.eval_reward_errors += int(distributed.sums({"errors": reward_errors})["errors"])
    state.last_accuracy, state.last_eval_round = scores["eval_accuracy"], state.round
    if state.first_accuracy is None:
        state.first_accuracy = state.last_accuracy
    return scores


def buffer_counts(buffer, state) -> dict:
    """The buffer's fill, and its rollouts gone so far by their uses (all processes; also kept in
    the loop state): the measured replay ratio."""
    longest = int(distributed.maxima({"n": len(buffer.left_by_uses)})["n"])
    mine = buffer.left_by_uses + [0] * (longest - len(buffer.left_by_uses))
    total = distributed.sums({"rollouts": len(buffer), **{str(i): n for i, n in enumerate(mine)}})
    state.left_by_uses = [int(total[str(i)]) for i in range(longest)]
    return {"buffer_fill": int(total["rollouts"]), "left_by_uses": state.left_by_uses}


def reset_peak_memory(model) -> None:
    """On a GPU: start measuring a phase's peak memory afresh (peak_memory reads it). Nothing on a CPU."""
    if next(model.parameters()).is_cuda:
        torch.cuda.reset_peak_memory_stats()


def peak_memory(stats: dict, phase: str, model) -> None:
    """On a GPU: the peak memory of a phase of the round ("gen", "train") in GB (2^30 bytes), the
    highest so far, into stats: allocated by tensors (<phase>_peak_mem_gb), reserved by the
    allocator (<phase>_reserved_gb); after "train", the round's peak_mem_gb. Then the peak is reset,
    for the next phase. Nothing on a CPU."""
    if not next(model.parameters()).is_cuda:
        return
    for key, peak in ((f"{phase}_peak_mem_gb", torch.cuda.max_memory_allocated()),
                      (f"{phase}_reserved_gb", torch.cuda.max_memory_reserved())):
        stats[key] = max(stats.get(key, 0.0), peak / 2**30)
    if phase == "train":
        stats["peak_mem_gb"] = max(stats.get("gen_peak_mem_gb", 0.0), stats["train_peak_mem_gb"])
    torch.cuda.reset_peak_memory_stats()


def save_config(run_dir: str, config: dict) -> None:
    """The run folder, with config.json (rank 0)."""
    if distributed.is_main():
        runfolder.check_writer(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "config.json")
        with runfolder.full_disk_as_one_line(run_dir, path):      # a full disk: one line (train.py)
            runfolder.write_json(path, config, indent=2)          # whole or not at all


def say(cfg, text: str) -> None:
    """A line of the start-up or end-of-run summary: printed once (rank 0), unless --no-progress."""
    if cfg.progress:
        try:
            distributed.print0(text)
        except BrokenPipeError:         # `train.py | head`: the reader left; the run goes on
            quiet_stdout()


def close_bars() -> None:
    """Closes every progress bar still drawn (its last state stays on its line), so that an ending
    line printed next starts a line of its own and no bar is redrawn below it."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        with contextlib.suppress(Exception):
            bar.close()


def quiet_stdout() -> None:
    """stdout to /dev/null from here on: its reader (a pipe) is gone."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def flush_stdout() -> None:
    """What stdout still holds, written at the end of a run; a reader that left (`train.py |
    head`) gets nothing more, and Python no BrokenPipeError at exit."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()
    except (OSError, ValueError):       # a closed terminal (SIGHUP), a closed stream
        pass


def start(cfg, task, world: int) -> None:
    """The start-up summary: the task, the round, and the derived quantities of replay."""
    R, N, B, K = cfg.rollouts_per_round, cfg.buffer_size, cfg.batch_size, cfg.updates_per_round
    say(cfg, f"task {task.name}: {len(task.train_prompts)} training prompts, "
        f"{min(cfg.eval_prompts, len(task.eval_prompts))} held-out eval prompts")
    say(cfg, f"round: P x G = {R} new rollouts ({cfg.prompts_per_round} prompts x "
        f"{cfg.num_generations}); K={K} updates of B={B} from a buffer of N={N}"
        + (f"; {world} processes, each 1/{world} of R, N and B" if world > 1 else ""))
    say(cfg, replay_line(cfg))
    if cfg.generators:
        say(cfg, async_line(cfg))
    S = cfg.new_per_update
    if cfg.reuse and (K * B > S if S else K * B > R or cfg.skip_zero_advantage):
        say(cfg, "this is experience replay: stored rollouts are used again in later updates; the "
            "rollout ages and the importance ratios in the metrics show how stale they are")


def replay_line(cfg) -> str:
    """The replay ratio and the staleness horizon the flags give, and where the measured ones differ."""
    R, N, B, K, S = (cfg.rollouts_per_round, cfg.buffer_size, cfg.batch_size,
                     cfg.updates_per_round, cfg.new_per_update)
    loss = f"loss {cfg.loss} (is_cap {cfg.is_cap}), lr {cfg.lr}"
    if not cfg.reuse:
        return f"each stored rollout used once (--no-reuse); {loss}"
    if S:
        line = (f"replay ratio K*B/S = {K * B / S:.2f} uses per stored rollout (K updates for "
                f"every S={S} stored); staleness horizon N/S = {N / S:.1f} updates")
        if K * B == S == N:
            line += " (on-policy: each used once, at age 0)"
    elif cfg.step_when_held:
        line = (f"replay ratio: the trainer steps on B={B} from the buffer whenever it holds them "
                f"(--step-when-held), so how often a rollout is used depends on the two speeds "
                f"(measured); staleness horizon N/R = {N / R:.1f} rounds")
    else:
        line = (f"replay ratio K*B/R = {K * B / R:.2f} uses per rollout; staleness horizon N/R = "
                f"{N / R:.1f} rounds")
        if cfg.skip_zero_advantage:
            line += (" of the rollouts generated; only groups whose rewards differ are stored "
                     "(--skip-zero-advantage), so each stored one is used more often: measured "
                     "in the metrics (left_by_uses) and the summary")
    return f"{line}; {loss}"


def async_line(cfg) -> str:
    """--generators: who generates, how the trainer waits, how stale the weights may be."""
    S, n = cfg.new_per_update, cfg.generators
    waits = ("steps once each round is in, on weights published after every step (--lockstep: "
             "ages 0, rho = 1)" if cfg.lockstep else
             f"steps once S={S} new rollouts are stored since its last step" if S else
             "steps whenever the buffer holds B (--step-when-held): the replay ratio is set by "
             "the two speeds, measured in the summary" if cfg.step_when_held else
             f"takes K={cfg.updates_per_round} steps for each round that arrives")
    lag = f"; a worker more than {cfg.max_lag} steps behind waits" if cfg.max_lag else ""
    cap = ("" if not cfg.step_when_held else
           f"; a rollout leaves the buffer after {cfg.max_uses} uses (--max-uses)" if cfg.max_uses
           else "; no cap on a rollout's uses (--max-uses 0)")
    return (f"async: {n} generation worker process{'es' if n > 1 else ''} sampling rounds while "
            f"the trainer {waits}; weights published every {cfg.sync_every} step(s){lag}; a worker "
            f"waits while the buffer has no room for its round unused{cap}; the workers are held "
            "while the trainer evaluates")


def async_lines(state, n_workers: int) -> list[str]:
    """The end-of-run lines of an async run: the wall time and what each side waited for."""
    wall = max(state.wall_seconds, 1e-9)
    return [f"async: {n_workers} worker(s), {state.wall_seconds:.1f} s of wall time; the trainer "
            f"waited {100 * state.trainer_wait_seconds / wall:.0f}% of it for rollouts, the "
            "workers "
            f"{100 * state.worker_weights_wait_seconds / n_workers / wall:.0f}% for weights and "
            f"{100 * state.worker_room_wait_seconds / n_workers / wall:.0f}% for room; per second "
            f"{state.rollouts_generated / wall:.1f} rollouts generated, "
            f"{state.rollouts_stored / wall:.1f} stored, {state.rollouts_trained / wall:.1f} "
            "trained on"] + ([f"--max-uses: {state.retired_at_cap:,} rollouts left the buffer at "
                              "the cap"] if state.retired_at_cap else [])


def resumed(cfg, state, saved_config: dict) -> None:
    """What a resume continues from: the end of a round, the next one begins."""
    say(cfg, f"resumed from {cfg.resume}: round {state.round}, step {state.step}")


# Replay (y = 2) against on-policy on SmolLM2-135M, sums, compute to first reach 0.45 (the decisive
# and confirmatory comparisons' 28 seeds, pooled): the cost ratio per rollout at which the mean of
# their per-seed log ratio is 0, below which the 90% interval lies wholly above 1 (replay costs
# more), and above which wholly below 1 (replay saves). From
# docs/results/smollm2_both_cost_ratio.json (comparison/cost_ratio.py), tested against it.
BREAK_EVEN, COSTS_MORE_BELOW, SAVES_ABOVE = 3.4, 1.3, 19


def summary(cfg, state, run_dir: str) -> None:
    """The end-of-run lines, all measured: accuracy, tokens and the time split, the
    generation/training cost ratio (seconds per generated rollout / per trained rollout; not mu,
    the behaviour policy), how often a rollout was used, and the counts of anything skipped.
    cfg: train.Config; state: checkpoint.LoopState."""
    first, last = state.first_accuracy, state.last_accuracy
    total = state.gen_seconds + state.train_seconds
    say(cfg, f"eval accuracy: {first:.3f} at step 0 -> {last:.3f} after {state.step} steps "
        f"({last - first:+.3f})")
    say(cfg, f"generated {state.gen_tokens} completion tokens in {state.round} rounds; time "
        f"generation {state.gen_seconds:.1f} s / training {state.train_seconds:.1f} s "
        f"({100 * state.gen_seconds / max(total, 1e-9):.0f}% generating)")
    generated, trained = state.rollouts_generated, state.rollouts_trained
    if generated and trained and state.train_seconds > 0:
        cost_ratio = (state.gen_seconds / generated) / (state.train_seconds / trained)
        say(cfg, f"generation/training cost ratio {cost_ratio:.2f}: seconds to generate one rollout "
            f"/ to train on one")
        say(cfg, f"for reference, from another experiment (docs/results.md): replay (y = 2) broke "
            f"even with on-policy at a cost ratio of {BREAK_EVEN} on SmolLM2-135M's sums (the "
            f"mean of 28 seeds; replay cost more below {COSTS_MORE_BELOW} and cost less above "
            f"{SAVES_ABOVE}, at 90%); a figure of that model and task, not of this run, "
            f"whose ratio is {'below' if cost_ratio < BREAK_EVEN else 'above'} it")
    for line in reuse_lines(state) + (async_lines(state, cfg.generators) if cfg.generators else []):
        say(cfg, line)
    if state.skipped_steps or state.reward_errors:
        say(cfg, f"skipped steps (NaN/inf): {state.skipped_steps}; reward errors scored 0: "
            f"{state.reward_errors}")
    if state.eval_reward_errors:
        say(cfg, f"reward errors scored 0 during evals: {state.eval_reward_errors}")
    if state.idle_rounds:
        say(cfg, f"rounds without an update (the buffer held fewer than B={cfg.batch_size} "
            f"rollouts): {state.idle_rounds}")
    if state.lapsed_updates:
        say(cfg, f"updates skipped because fewer than B rollouts were left (each used once with "
            f"--no-reuse, or older than --max-age): {state.lapsed_updates}")
    curves = ", curves.png" if cfg.plot and importlib.util.find_spec("matplotlib") else ""
    say(cfg, f"run folder: {run_dir} (metrics.jsonl, adapter/, checkpoint-{state.round}/{curves})")


def reuse_lines(state) -> list[str]:
    """The measured replay: rollouts generated, stored and trained on, the uses of the stored ones
    (those gone from the buffer, counted by their uses) and the ages they were trained at."""
    generated, stored, trained = state.rollouts_generated, state.rollouts_stored, state.rollouts_trained
    if not (generated and stored and trained):
        return []
    lines = [f"rollouts: {generated:,} generated, {stored:,} stored ({100 * stored / generated:.0f}%), "
             f"{trained:,} trained on: each stored one used {trained / stored:.2f} times on average"]
    gone = sum(state.left_by_uses)
    if gone:
        counts = ", ".join(f"{n:,} {uses}x" for uses, n in enumerate(state.left_by_uses) if n)
        lines.append(f"of the {gone:,} that left the buffer, by uses: {counts}; trained on at age "
                     f"{state.age_sum / trained:.2f} steps on average, {state.age_max} at most")
    return lines


def quiet_libraries() -> None:
    """Hide library chatter that says nothing of the run (weight-loading bars, optional kernels)."""
    import logging
    import warnings

    import transformers
    for library in ("bitsandbytes", "kernels"):     # optional kernels' notices, offline checks
        logging.getLogger(library).setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    warnings.filterwarnings("ignore", message=".*torch.jit.script_method.*")
