"""What ends a round and the run (train.py's and async_rl.py's loops call them by name): the eval
and the checkpoint when due, the progress bar; at the end the last eval and checkpoint, the adapter
and the summary. ``run`` is train.Run."""
from __future__ import annotations

import os
from dataclasses import asdict

from infra import checkpoint, cli, distributed, generation, loading, report, runfolder


def held_out_eval(run) -> float:
    """Greedy accuracy on the held-out prompts (each process scores its share); an eval line; the
    next eval's token count (--eval-every-tokens, --eval-at-tokens)."""
    state, task = run.state, run.task
    prompts = task.eval_prompts[:run.cfg.eval_prompts]
    mine = distributed.share(prompts)
    run.model.eval()
    errors_before = run.reward_fn.errors
    fns = loading.eval_rewards(task, run.reward_fn)     # eval_accuracy (GSM8K: strict, lenient)
    limit = run.cfg.max_new_tokens or task.max_new_tokens
    with run.pause_workers():           # async: nothing generated while the clock stands
        # cut short outside a round (async): nothing of it kept
        with run.stop.abortable(state), report.timed(state, "eval"):
            means = dict.fromkeys(fns, 0.0) if not mine else generation.greedy_rewards(
                run.model, run.tokenizer, mine, fns, max_new_tokens=limit)
        run.mode_for_steps()            # back to the mode the steps run in (train.Run)
        scores = report.count_eval(state, means, len(mine), run.reward_fn.errors - errors_before)
        run.reporter.row(state, {**scores, "eval_reward_errors": state.eval_reward_errors})
        with report.timed(state, "eval"):   # out of the wall clock, as the eval itself
            run.reporter.curves()
    state.next_eval_tokens = cli.next_eval_tokens(run.cfg, state.gen_tokens)
    return state.last_accuracy


def eval_due(run) -> bool:
    """Whether this round ends with an eval: every --eval-every rounds, or once the generated
    tokens reach the next of --eval-every-tokens / --eval-at-tokens (runs' curves line up)."""
    cfg, state = run.cfg, run.state
    if cfg.eval_every_tokens or cfg.eval_at_tokens:
        return state.gen_tokens >= state.next_eval_tokens
    return state.round % cfg.eval_every == 0


def end_of_round(run) -> None:
    """The progress bar; a checkpoint when due (--save-every)."""
    run.reporter.progress(run.state)
    if run.cfg.save_every and run.state.round % run.cfg.save_every == 0:
        save(run)


def budget_spent(run) -> bool:
    """The run's budget is in: --max-rounds rounds, or --max-gen-tokens generated tokens."""
    state, cfg = run.state, run.cfg
    return state.round >= cfg.max_rounds or 0 < cfg.max_gen_tokens <= state.gen_tokens


def save(run) -> str:
    """The run's checkpoint as it stands (checkpoint-<round>); the round it saved, in run."""
    path = checkpoint.save(run.out, asdict(run.state), asdict(run.cfg), model=run.model,
                           optimizer=run.optimizer, buffer=run.buffer, rng=run.rng)
    run.saved_state = asdict(run.state)
    return path


def finish(run) -> dict:
    """The last eval, the adapter and the last checkpoint, and the end-of-run summary. The adapter,
    the smallest, is written first: on a disk that fills up, what was trained is kept (DiskFull
    then names it, ``kept``)."""
    state = run.state
    if state.last_eval_round != state.round:
        with run.stop.round(run, "the last eval"):  # a stop in it: done again on resume
            held_out_eval(run)
    adapter = os.path.join(run.out, "adapter")
    checkpoint.save_adapter(run.model, adapter)
    try:
        if run.saved_state != asdict(state):  # not saved as it stands (--save-every saved it)
            save(run)
    except runfolder.DiskFull as e:
        e.kept = adapter
        raise
    run.reporter.close()
    report.summary(run.cfg, state, run.out)
    distributed.close()
    return {"first_accuracy": state.first_accuracy, "final_accuracy": state.last_accuracy,
            "output_dir": run.out, **asdict(state)}
