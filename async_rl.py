"""The paper's system: generation workers that sample while the trainer steps, pushing rollouts to
its buffer. The two loops come first (``train_async``, the trainer; ``worker_loop``, a worker),
then the trainer's rules (how many steps a round makes due, when to order a round, one step). The
processes, queues and weight sharing sit in infra/workers.py (``Generators`` on the trainer's side,
``WorkerLink`` on a worker's). It holds nothing of the method; what the rules below read of its
``Generators`` is listed at the end of this docstring.

    python train.py --generators 1          # one worker process generates while the trainer steps

    worker (--generators of them, each a process with its own copy of the policy)
        for each order (P prompts) the trainer gives:
            load the newest published weights (--max-lag: wait for the next publish if they are
            more than --max-lag steps behind the trainer)
            rollouts <- G samples per prompt, with log mu and A, stamped with that version
            push them to the trainer
    trainer (train.py's process)
        publish the adapter's weights; evaluate (step 0)
        until the budget of rounds is in, one pass at a time:
            order rounds: at most rounds_ahead on their way, each only while the buffer has room
            for its rollouts unused (one anyway when none is on its way and no step can free room)
            --step-when-held, no round arrived yet: one step (if the buffer holds B), next pass
            else take the next round that arrived (wait for it) -> buffer.add
            its steps, as in the synchronous loop: K once the buffer holds B (with S: K for every
            S stored; --step-when-held: one); each samples B, orders the rounds that this sample
            made room for (they generate during the step), takes one optimizer step and every
            --sync-every steps publishes the weights
            eval and checkpoint when due
Rounds are ordered at the two moments room can appear: at the top of a pass (a round arrived and
was stored since the last) and inside each step, between its sample and the update.

K and S count as in the synchronous loop: no step before the buffer holds B; then K steps for
each round that arrives (S = 0), or K steps for every S rollouts stored (S > 0). Two things
differ, because the workers sample while the trainer steps. Every round that arrives is stored
whole, and the count of stored rollouts carries over (the synchronous loop stores just the S it
needs and drops the rest of the round): with R > S a round here makes K * R / S steps due, there
K. And a stored rollout may be of an older policy than the trainer's. --learning-starts is the
synchronous loop's only. The flags of this loop alone:
  --generators n, --generator-devices, --sync-every, --worker-timeout: the workers, their devices,
    how often the trainer publishes its weights, how long a silent worker may take;
  --step-when-held: the paper's trainer, a step whenever the buffer holds B, K and S aside, so
    that the two speeds set the replay ratio (measured, not chosen);
  --max-uses U (with --step-when-held; default 4): a rollout used U times leaves, so that a pause
    of generation cannot turn into unbounded reuse; 0 is the paper's uncapped form;
  --max-lag (with --step-when-held): a worker whose weights are further behind waits;
  --lockstep: each round ordered only once the weights of every step before it are published,
    so each rollout is trained on at age 0 with rho = 1, as in the synchronous loop (a check of
    exactness, not a way to train).
What the rules below read of ``workers`` (infra/workers.py's Generators): ``outstanding``, the
rounds ordered and not yet arrived; ``delivered``, whether any round has arrived; ``published``,
the version of the weights published last; ``order(prompts)``; ``take_round(wait)``, the next
round that arrived as (rollouts, figures), or None (wait=False: none has arrived; wait=True: a stop
came while it waited); ``publish(model, step)``; ``account(state)`` (the time split, into the
figures); and ``trainer_at(step)``, which tells a worker past --max-lag to wait. The trainer is one
process (cli.py refuses --generators under torchrun), so B here is --batch-size whole.
Async runs are not bit-reproducible: which version a worker samples with, and which rounds
arrive before a step, depend on how fast each process runs. A worker waits for an order (none
while the buffer has no room for a round unused, or rounds_ahead rounds are on their way) and,
with --max-lag, for newer weights; during an eval the trainer holds it stopped, off the clocks.
"""
from __future__ import annotations

import math

import rollout
from buffer import Rollout
from infra import generation, report
from infra.round_end import budget_spent, end_of_round, eval_due, held_out_eval
from infra.workers import Generators


# ---- the two loops ---------------------------------------------------------------------------
def train_async(run, sample_batch, take_step) -> None:
    """The trainer, the README's async box. train.py's steps: sample_batch(run, max_uses) (B
    from the buffer, or None) and take_step(run, sampled, B) (update_step, timed and recorded).
    Returns when the budget is in or a stop was asked (the caller saves)."""
    cfg, state = run.cfg, run.state
    with Generators(run, worker_loop) as workers:   # the processes; all stopped on the way out
        workers.publish(run.model, state.step)      # the weights the first rounds sample with
        if state.first_accuracy is None:
            held_out_eval(run)                      # step 0, while the workers load their models
        while (not budget_spent(run) or workers.outstanding) and not run.stop.requested():
            order_rounds(run, workers)              # what room there is (one_step orders too)
            arrived = workers.take_round(wait=False)            # a round that arrived, or None
            if arrived is None and cfg.step_when_held:  # the paper's trainer steps while it waits
                if one_step(run, workers, sample_batch, take_step):
                    continue                        # a step taken: the next pass
            if arrived is None:
                arrived = workers.take_round(wait=True)         # wait for the next round
                if arrived is None:                 # a stop, asked while it waited
                    return
            steps = store(run, *arrived)            # buffer.add; the steps it makes due
            for k in range(steps):
                if not one_step(run, workers, sample_batch, take_step):    # too few left: the
                    state.lapsed_updates += steps - k                 # rest lapse, counted
                    break
            workers.account(state)                  # the time split, into the round's figures
            if eval_due(run):
                held_out_eval(run)
            end_of_round(run)                       # the progress bar, a checkpoint when due


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
        rollouts, figures = rollout.generate_rollouts(
            model, tokenizer, prompts, reward_fn, num_generations=cfg.num_generations,
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            policy_version=version,                                             # as train.py
            sampler=generation.run_sampler(cfg.record_log_mu, link.fast))   # train.py's way
        link.push(rollouts, figures)


# ---- the trainer's rules ---------------------------------------------------------------------
def store(run, rollouts: list[Rollout], figures: dict) -> int:
    """A round that arrived: every rollout into the buffer (but those the zero-advantage filter
    drops), counted, its row. Returns the optimizer steps it makes due: none while the buffer
    holds fewer than B; then K (S = 0), or K for every S rollouts stored since (S > 0); with
    --step-when-held one (the trainer steps on while it waits for the next round). (--lockstep
    comes with S = 0: cli.py refuses it with S.)"""
    cfg, state = run.cfg, run.state
    state.round += 1
    stored = run.buffer.add(rollouts)
    run.buffer.drop_stale(state.step)
    report.count_round(state, figures, len(rollouts), len(rollouts) // cfg.num_generations,
                       figures["reward_errors"], stored)
    run.reporter.row(state, {**state.round_stats, "updates": 0,      # the round's row (no step)
                           **report.buffer_counts(run.buffer, state)})
    held = len(run.buffer) >= cfg.batch_size
    if cfg.step_when_held:          # one now (a trainer slower than the workers, always finding a
        return int(held)            # round arrived, still steps); the rest in passes with none
    if not held:                    # no step before the buffer holds B, as in the synchronous
        state.idle_rounds += 1      # loop; rounds stored before then do not count toward S (the
        return 0                    # one that brings it to B counts whole)
    if cfg.new_per_update:                          # K for every S stored
        state.new_since_step += stored
        due, state.new_since_step = divmod(state.new_since_step, cfg.new_per_update)
        return cfg.updates_per_round * due
    return cfg.updates_per_round


def can_step(run, workers) -> bool:
    """Whether the trainer may step: the buffer holds B and a round has arrived (a resumed buffer
    is not stepped on while the workers load their models)."""
    return len(run.buffer) >= run.cfg.batch_size and workers.delivered


def one_step(run, workers, sample_batch, take_step) -> bool:
    """One optimizer step on B rollouts from the buffer, if can_step; else False (and False if
    --max-uses leaves fewer than B to sample). Between the sample and the step it orders the rounds
    the sample made room for, so that they generate during the step. The weights are published
    every --sync-every steps; a worker past --max-lag learns the trainer's new step."""
    cfg, state = run.cfg, run.state
    if not can_step(run, workers):
        return False
    cap = cfg.max_uses if cfg.step_when_held and cfg.reuse and cfg.max_uses else None
    sampled = sample_batch(run, cap)                        # --max-uses: at most that often
    if sampled is None:
        return False
    if not cfg.lockstep:                        # (lockstep: the next round waits for this step)
        order_rounds(run, workers)              # the room the sample freed: generated during it
    workers.account(state)                      # the time split, into this step's metrics row
    take_step(run, sampled, cfg.batch_size)     # one optimizer step: the policy's version + 1
    workers.trainer_at(state.step)              # a worker past --max-lag waits on it
    if state.step % cfg.sync_every == 0:
        workers.publish(run.model, state.step)
    return True


def rounds_ahead(n_workers: int, batch_size: int, rollouts_per_round: int) -> int:
    """How many rounds the trainer keeps on their way: a batch's worth, ceil(B / R), plus one per
    worker. It orders only between steps, so what it ordered before a step is all the workers have
    to generate during it (with two per worker, a step fed by four rounds left the worker idle for
    part of every step)."""
    return n_workers + math.ceil(batch_size / rollouts_per_round)


def room_for_a_round(run, outstanding: int) -> bool:
    """Whether one more round may be ordered without pushing an unused rollout out of the buffer.
    A round stores at most P x G rollouts (the README's R is what it does store). With
    ``outstanding`` rounds on their way, one more means that once all have arrived the buffer has
    gained (outstanding + 1) x P x G; past the capacity N the oldest leave (FIFO). ``evicted``
    counts them. There is room if each of them, the oldest ``evicted`` items now, has been used.
    Worked example (the demo's sizes, P x G = 128, N = 256): the buffer holds 256, the older 128
    used, the newer 128 not yet.
      none on their way: evicted = 256 + 1 x 128 - 256 = 128, the older 128, all used: room.
      one on its way:    evicted = 256 + 2 x 128 - 256 = 256, the newer 128 among them: no room;
                         the order waits until a step has used them.
    evicted > len(items), more than the buffer holds, would evict rollouts of the ordered rounds
    themselves, unused: no room."""
    most_stored, items = run.cfg.rollouts_per_round, run.buffer.items
    evicted = len(items) + (outstanding + 1) * most_stored - run.cfg.buffer_size
    return evicted <= len(items) and all(old.uses > 0 for old in items[:max(evicted, 0)])


def order_rounds(run, workers) -> None:
    """Orders for the workers, a round's P prompts each (drawn from the run's prompt stream, here,
    so a checkpoint keeps it), until the budget is in: at most rounds_ahead of them on their way,
    and each only while the buffer has room for its rollouts unused (room_for_a_round). One
    exception: with none on its way and no step the trainer can take while it waits (only
    --step-when-held steps between rounds, and only once can_step), nothing would ever free room,
    so a round is ordered anyway; an unused rollout it evicts is counted (left_by_uses).
    --lockstep: one round at a time, once the weights of every step before it are published."""
    cfg, state = run.cfg, run.state
    ahead = rounds_ahead(cfg.generators, cfg.batch_size, cfg.rollouts_per_round)
    while (workers.outstanding < ahead          # state.round: the rounds arrived so far
           and state.round + workers.outstanding < cfg.max_rounds
           and not 0 < cfg.max_gen_tokens <= state.gen_tokens):
        if not room_for_a_round(run, workers.outstanding):
            # Room comes by waiting when a round is on its way (its steps use rollouts) or the
            # trainer steps while it waits (--step-when-held, once can_step): then wait for it
            if workers.outstanding or (cfg.step_when_held and can_step(run, workers)):
                return
            # else nothing would ever free room: the round is ordered anyway (the exception)
        if cfg.lockstep and (workers.outstanding or workers.published < state.step):
            return                          # the weights of every step before it, published
        workers.order(run.rng.sample(run.task.train_prompts, cfg.prompts_per_round))
