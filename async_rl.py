"""The paper's system: generation workers that sample while the trainer steps, pushing rollouts to
its buffer. A worker waits for an order (order_rounds: none while the buffer has no room for a round
unused, or rounds_ahead rounds are on their way; orders go out between steps) and, with --max-lag,
for newer weights; during an eval the trainer holds it stopped, off the clocks.

    python train.py --generators 1          # one worker process generates while the trainer steps

    worker (--generators of them, each a process with its own copy of the policy)
        for each order (P prompts) the trainer gives:
            load the newest published weights (--max-lag: wait for the next publish if they are
            more than --max-lag steps behind the trainer)
            rollouts <- G samples per prompt, with log mu and A, stamped with that version
            push them to the trainer
    trainer (train.py's process)
        publish the adapter's weights; evaluate (step 0)
        until the budget of rounds is in:
            order rounds while the buffer has room for their rollouts unused
            take what the workers pushed -> buffer.add (every round whole, but the rollouts the
            zero-advantage filter drops; --max-age and eviction can drop a rollout unused: counted)
            when a step is due (B in the buffer; with S, S new ones since the last steps):
                sample B -> one optimizer step; every --sync-every steps publish the weights
            eval and checkpoint when due

S = --new-per-update keeps its meaning: K steps for every S new rollouts stored; S = B = N is async
on-policy (each rollout used once, a step or so stale). S = 0, the paper's sampler: the trainer
steps whenever the buffer holds B (K plays no part), and the replay ratio is set by the two rates
(measured, not chosen), up to --max-uses U (default 4): a rollout used U times leaves, so once
what it holds is used up the trainer waits for rounds; --max-uses 0 is the paper's uncapped form. --lockstep orders each round only once the weights of
every step before it are published: each rollout is then trained on at age 0 with rho = 1, as in
the synchronous loop (a check of exactness, not a way to train). Async runs are not
bit-reproducible: which version a worker samples with, and which rounds arrive before a step,
depend on how fast each process runs.

The two loops come first (``train_async``, ``worker_loop``), then the trainer's rules (when to
order a round, when a step is due, when the run is over). The processes, queues and weight sharing
sit in infra/workers.py (``Generators`` on the trainer's side, ``WorkerLink`` on a worker's).
"""
from __future__ import annotations

import math

import rollout
from buffer import Rollout
from infra import report
from infra.round_end import end_of_round, evaluate
from infra.workers import Generators


# ---- the two loops ---------------------------------------------------------------------------
def train_async(run, sample_batch, take_step) -> None:
    """The trainer, the README's async box: publish the weights, evaluate; then until the budget is
    in: order rounds while the buffer has room, add what arrived, step when due, publish, eval and
    save when due. train.py's steps: sample_batch(run, B) (B from the buffer, or None), and
    take_step(run, sampled, B) (update_step, timed and recorded). Returns when the budget is in or
    a stop was asked (the caller saves)."""
    cfg, state, B = run.cfg, run.state, run.cfg.batch_size
    with Generators(run, worker_loop) as workers:   # the processes; all stopped on the way out
        workers.publish(run.model, state.step)      # the weights the first rounds sample with
        if state.first_accuracy is None:
            evaluate(run)                           # step 0, while the workers load their models
        while not finished(run, workers) and not run.stop.requested():
            order_rounds(run, workers)              # P prompts a round, while N has room
            # the trainer waits for a round only when no step is due
            if not state.round_end_due and (arrived := workers.take_round(
                    wait=not step_due(run, workers))):
                store(run, *arrived)                # buffer.add(every rollout that arrived)
            if step_due(run, workers) and (sampled := take_batch(run, sample_batch, B)):
                order_rounds(run, workers)          # the room it freed: generated during the step
                workers.account(state)              # the time split, into this step's metrics row
                take_step(run, sampled, B)          # one optimizer step: the policy's version + 1
                state.pending_updates -= 1          # one step due fewer
                if state.step % cfg.sync_every == 0:
                    workers.publish(run.model, state.step)
            if state.round_end_due and not (state.pending_updates and step_due(run, workers)):
                workers.account(state)              # the round's due steps taken (or none can be):
                end_of_round(run)                   # eval, progress bar, checkpoint


def worker_loop(model, tokenizer, reward_fn, cfg, link) -> None:
    """A worker: for each order, the newest weights, one round of rollouts, pushed. It waits twice:
    for an order (order_rounds says when the trainer gives one) and, with --max-lag, for the next
    publish when the newest weights are more steps behind the trainer than it. cfg: the run's Config
    with max_new_tokens resolved (> 0); each worker samples from its own torch RNG stream
    (workers.py's worker_main seeds it: two workers with one stream would sample the same
    completions)."""
    if not cfg.max_new_tokens > 0:
        raise ValueError(f"max_new_tokens {cfg.max_new_tokens}: give the completions' limit (> 0)")
    model.eval()        # dropout off, as load_policy leaves it: it samples as the trainer trains
    while (prompts := link.next_order()) is not None:       # waits until the trainer orders
        version = link.load_weights(model)                  # waits if past --max-lag behind
        rollouts, gen = rollout.generate_rollouts(
            model, tokenizer, prompts, reward_fn, num_generations=cfg.num_generations,
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
            policy_version=version, fast=link.fast)
        link.push(rollouts, gen)


# ---- the trainer's rules ---------------------------------------------------------------------
def store(run, rollouts: list[Rollout], gen: dict) -> None:
    """A round that arrived: every rollout into the buffer (but those the zero-advantage filter
    drops), counted; the optimizer steps it makes due (with S: K for every S new ones)."""
    cfg, state = run.cfg, run.state
    state.round += 1
    stored = run.buffer.add(rollouts)
    run.buffer.drop_stale(state.step)
    report.count_round(state, gen, len(rollouts), len(rollouts) // cfg.num_generations,
                       gen["reward_errors"], stored)
    state.new_since_step += stored
    S = cfg.new_per_update
    if cfg.lockstep:                            # as the synchronous loop: K updates each round
        due = len(run.buffer) >= cfg.batch_size
        state.pending_updates = cfg.updates_per_round if due else 0
        state.idle_rounds += not due
    while S and state.new_since_step >= S:
        state.pending_updates += cfg.updates_per_round
        state.new_since_step -= S
    state.round_end_due = True
    run.report.row(state, {**state.round_stats, "updates": 0,      # the round's row (no step)
                           **report.buffer_counts(run.buffer, state)})


def take_batch(run, sample_batch, B: int):
    """sample_batch(run, B). With S = 0 (no --lockstep) the paper's rule acts here: a step is
    always due, so one update is set due and new_since_step (read by `finished`) reset to 0."""
    state = run.state
    if not (run.cfg.new_per_update or run.cfg.lockstep):
        state.pending_updates, state.new_since_step = 1, 0
    return sample_batch(run, B)


def step_due(run, workers) -> bool:
    """Whether the trainer steps now: B rollouts in the buffer and, with S or --lockstep, an
    update due; with S = 0, whenever B are held (rollouts used --max-uses times have left). Never
    before a round has arrived from the workers: a resumed buffer is not stepped on while they
    load their models (each rollout's uses stay within --max-uses in any case)."""
    if len(run.buffer) < run.cfg.batch_size or not workers.delivered:
        return False
    return run.state.pending_updates > 0 or not (run.cfg.new_per_update or run.cfg.lockstep)


def finished(run, workers) -> bool:
    """The budget is in (rounds or tokens), no round is on its way, and no step is due: with
    S = 0, one step was taken since the last round arrived."""
    state = run.state
    if not budget_spent(run) or workers.outstanding or state.round_end_due:
        return False
    if run.cfg.new_per_update or run.cfg.lockstep:
        return not (state.pending_updates and len(run.buffer) >= run.cfg.batch_size)
    return state.new_since_step == 0 or len(run.buffer) < run.cfg.batch_size


def budget_spent(run) -> bool:
    state, cfg = run.state, run.cfg
    return state.round >= cfg.max_rounds or 0 < cfg.max_gen_tokens <= state.gen_tokens


def rounds_ahead(n_workers: int, batch_size: int, rollouts_per_round: int) -> int:
    """How many rounds the trainer keeps on their way: a batch's worth, ceil(B / R), plus one per
    worker. It orders only between steps, so what it ordered before a step is all the workers have
    to generate during it (with two per worker, a step fed by four rounds left the worker idle for
    part of every step)."""
    return n_workers + math.ceil(batch_size / rollouts_per_round)


def room_for_a_round(run, outstanding: int) -> bool:
    """Whether a round of R = P x G more rollouts (the most a round stores), after those on their
    way, would evict (FIFO: the oldest first) only rollouts already used: the worker waits instead
    of generating what would push an unused one out."""
    R, items = run.cfg.rollouts_per_round, run.buffer.items
    evicted = len(items) + (outstanding + 1) * R - run.cfg.buffer_size
    return evicted <= len(items) and all(old.uses > 0 for old in items[:max(evicted, 0)])



def budget_spent_with(run, outstanding: int) -> bool:
    """The budget spent once the rounds on their way arrive (rounds; tokens as counted so far)."""
    state, cfg = run.state, run.cfg
    return (state.round + outstanding >= cfg.max_rounds
            or 0 < cfg.max_gen_tokens <= state.gen_tokens)


def order_rounds(run, workers) -> None:
    """Orders for the workers, a round's P prompts each (drawn from the run's prompt stream, here,
    so a checkpoint keeps it): while the buffer has room for their rollouts unused
    (room_for_a_round), at most rounds_ahead of them on their way, until the budget is in. A worker
    without an order waits: its wait for room. If the trainer has nothing to do without one (no
    step due, nothing on its way) it orders anyway: an unused rollout evicted is counted
    (left_by_uses), where waiting for room would never end. --lockstep: one round at a time, once
    the weights of every step before it are published."""
    cfg, state = run.cfg, run.state
    workers.trainer_at(state.step)              # a worker past --max-lag waits on it
    ahead = rounds_ahead(cfg.generators, cfg.batch_size, cfg.rollouts_per_round)
    while (workers.outstanding < ahead
           and not budget_spent_with(run, workers.outstanding)
           and (room_for_a_round(run, workers.outstanding)
                or (workers.outstanding == 0 and not step_due(run, workers)))):
        if cfg.lockstep and (workers.outstanding or workers.published < state.step
                             or state.pending_updates):
            return                          # the weights of every step before it, published
        workers.order(run.rng.sample(run.task.train_prompts, cfg.prompts_per_round))
