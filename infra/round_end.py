"""What ends a round and the run (train.py's and async_rl.py's loops call them by name): the eval
and the checkpoint when due, the progress bar; at the end the last eval and checkpoint, the adapter
and the summary. ``run`` is train.Run."""
from __future__ import annotations

import os
from dataclasses import asdict

import rollout
from infra import checkpoint, cli, distributed, loading, report


def evaluate(run) -> float:
    """Greedy accuracy on the held-out prompts (each process scores its share); an eval line."""
    state, task = run.state, run.task
    prompts = task.eval_prompts[:run.cfg.eval_prompts]
    mine = distributed.share(prompts)
    run.model.eval()
    errors_before = run.reward_fn.errors
    fns = loading.eval_rewards(task, run.reward_fn)     # eval_accuracy (GSM8K: strict, lenient)
    limit = run.cfg.max_new_tokens or task.max_new_tokens
    with run.pause_workers():           # async: nothing generated while the clock stands
        # cut short: nothing of it kept (its time neither), a resume evaluates again
        with run.stop.abortable(), report.timed(state, "eval"):
            means = dict.fromkeys(fns, 0.0) if not mine else rollout.greedy_rewards(
                run.model, run.tokenizer, mine, fns, max_new_tokens=limit)
        run.model.train()
        scores = report.count_eval(state, means, len(mine), run.reward_fn.errors - errors_before)
        run.report.row(state, {**scores, "eval_reward_errors": state.eval_reward_errors})
        with report.timed(state, "eval"):   # out of the wall clock, as the eval itself
            run.report.curves()
    return state.last_accuracy


def end_of_round(run) -> None:
    """Eval when due, the progress bar, a checkpoint when due."""
    cfg, state = run.cfg, run.state
    if cfg.eval_every_tokens or cfg.eval_at_tokens:     # fixed token counts: runs' curves line up
        if state.gen_tokens >= state.next_eval_tokens:
            evaluate(run)
            state.next_eval_tokens = cli.next_eval_tokens(cfg, state.gen_tokens)
    elif state.round % cfg.eval_every == 0:
        evaluate(run)
    state.round_end_due = False
    run.report.progress(state)
    if cfg.save_every and state.round % cfg.save_every == 0:
        save(run)


def save(run) -> str:
    return checkpoint.save(run.out, asdict(run.state), asdict(run.cfg), model=run.model,
                           optimizer=run.optimizer, buffer=run.buffer, rng=run.rng)


def finish(run) -> dict:
    """The last eval and checkpoint, the adapter, and the end-of-run summary."""
    state = run.state
    if state.last_eval_round != state.round:
        evaluate(run)
    save(run)
    run.report.close()
    checkpoint.save_adapter(run.model, os.path.join(run.out, "adapter"))
    report.summary(run.cfg, state, run.out)
    distributed.close()
    return {"first_accuracy": state.first_accuracy, "final_accuracy": state.last_accuracy,
            "output_dir": run.out, **asdict(state)}
