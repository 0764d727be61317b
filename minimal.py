"""RL post-training with experience replay, the whole method on one screen.

    python minimal.py       # the demo model learns to carry in 2-digit sums, a minute or so on CPU

Each round: sample G completions for each of P prompts with the current policy, storing for every
token o_t its behaviour log-prob log mu(o_t) and for every completion its group-normalized advantage
A = (r - mean(r)) / (std(r) + 1e-4) (the sample std), 0 for a group of equal rewards. Add the
R = P x G new rollouts to a FIFO buffer of N; take K = 1 optimizer step on B rollouts drawn from it
uniformly. Here B = N = 256: once full, every step takes the whole buffer (B < N draws a subset),
so with R = 128 each rollout is used twice (replay ratio y = K*B/R = 2), fresh and a step stale.
The staleness is corrected by truncated importance weights (w_t without gradient; token mean over
the batch):
    rho_t = pi_theta(o_t) / mu(o_t),   w_t = min(rho_t, C),   loss = - sum_t w_t A log pi_theta(o_t)
train.py runs this loop with every option, checkpoints and several GPUs; tests/test_minimal.py
checks that the update here gives train.py's loss and gradient.
"""
import logging
import random

import torch

from infra import demo_model
import tasks
from buffer import ReplayBuffer, collate
from replay_rl import completion_logp, load_policy, policy_loss
from rollout import generate_rollouts, greedy_accuracy

P, G = 16, 8                # prompts per round x completions per prompt: R = 128 new rollouts
N, B = 256, 256             # buffer capacity; rollouts per optimizer step: each used K*B/R = 2x
LR, IS_CAP = 1e-3, 2.0      # AdamW learning rate of the LoRA weights; C, the weights' cap
TEMPERATURE = 1.0           # T: mu samples at it and the loss takes log pi_theta at it, the same T
ROUNDS, EVAL_EVERY = 100, 25


def update(model, optimizer, rollouts, pad_id: int, *, temperature: float, is_cap: float,
           max_grad_norm: float = 1.0) -> dict:
    """One truncated-IS policy-gradient step on a batch of rollouts, on the model's device, skipped
    if its loss or gradient is NaN/inf; the loss and metrics. temperature: the T the rollouts were
    sampled at; is_cap: C."""
    device = next(model.parameters()).device
    cols = collate(rollouts, pad_id, device=device)     # padded: tokens, masks, logp, advantages
    # log pi_theta(o_t), [batch, max_len]
    logp, _ = completion_logp(model, cols, temperature)
    loss, metrics = policy_loss(logp, cols["behaviour_logp"], cols["advantage"],
                                cols["completion_mask"], is_cap=is_cap)
    optimizer.zero_grad()
    loss.backward()
    # a guard against a rare huge step (one batch of unlucky ratios), not part of the method
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                               max_grad_norm)
    skipped = not (torch.isfinite(loss) and torch.isfinite(grad_norm))   # NaN/inf: poison for good
    if not skipped:
        optimizer.step()
    return {"loss": loss.item(), "skipped": int(skipped),
            **{k: v.item() for k, v in metrics.items()}}


def evaluate(model, tokenizer, task, eval_prompts: int) -> float:
    """Greedy accuracy on the first eval_prompts held-out prompts."""
    model.eval()
    return greedy_accuracy(model, tokenizer, task.eval_prompts[:eval_prompts], task.reward,
                           max_new_tokens=task.max_new_tokens)


def main(rounds: int = ROUNDS, eval_every: int = EVAL_EVERY, eval_prompts: int = 500, seed: int = 0,
         log=print) -> list[float]:
    """Train the demo model; returns the held-out greedy accuracy at round 0 (before any), every
    eval_every rounds and at the end. Rounds count from 1, as in train.py."""
    if B > N:
        raise ValueError(f"B = {B} > N = {N}: the buffer never holds a batch, so nothing would "
                         "train")
    if P * G > N:
        raise ValueError(f"R = {P * G} > N = {N}: the oldest rollouts of each round would "
                         "leave the buffer before any batch could use them")
    rng = random.Random(seed)
    task = tasks.addition_task(2)
    # Seeded after the demo model: building it (on first use only, then cached) draws random
    # numbers, so a seed set before it would train differently on a first run and on later ones.
    base = demo_model.tiny_model(task)
    torch.manual_seed(seed)
    model, tokenizer = load_policy(base, lora_r=16)                    # the base model + a new LoRA
    # beta2 0.99 (not 0.999): the second moment follows the gradient's scale within ~100 steps, as
    # the policy and its rewards move; no weight decay: it would pull the adapter back to the base
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  betas=(0.9, 0.99), weight_decay=0.0)
    buffer = ReplayBuffer(N, seed=seed)
    step, accuracy = 0, [evaluate(model, tokenizer, task, eval_prompts)]
    log(f"round 0: held-out accuracy {accuracy[-1]:.3f}")
    for round_ in range(1, rounds + 1):
        model.eval()        # generate: the behaviour log-probs are recorded while sampling
        prompts = rng.sample(task.train_prompts, P)
        rollouts, stats = generate_rollouts(model, tokenizer, prompts, task.reward,
                                            num_generations=G, max_new_tokens=task.max_new_tokens,
                                            temperature=TEMPERATURE, policy_version=step)
        buffer.add(rollouts)                        # FIFO: the oldest rollouts leave first
        if len(buffer) >= B:
            # safe for the ratios: load_policy set dropout to 0, so it samples as it trains
            model.train()
            metrics = update(model, optimizer, buffer.sample(B), tokenizer.pad_token_id,
                             temperature=TEMPERATURE, is_cap=IS_CAP)
            step += 1
            if step % 10 == 0:
                log(f"round {round_}: reward {stats['reward']:.2f}, is_ratio_mean "
                    f"{metrics['is_ratio_mean']:.4f}, weights cut at C "
                    f"{metrics['is_truncated_frac']:.3f}")
        if round_ % eval_every == 0 or round_ == rounds:
            accuracy.append(evaluate(model, tokenizer, task, eval_prompts))
            log(f"round {round_}: held-out accuracy {accuracy[-1]:.3f}")
    return accuracy


if __name__ == "__main__":
    for library in ("bitsandbytes", "kernels"):     # notices of optional kernels, not of the method
        logging.getLogger(library).setLevel(logging.ERROR)
    main()
