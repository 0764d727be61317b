"""The engineering around replay_rl.update_step: the same step, the same gradient, with what a real
run needs besides (train.py takes it where needed() says its flags need it; tests keep it
equal to update_step):

    update_step_engineered     micro-batches (gradient accumulation), several processes (torchrun),
                               float16 loss scaling, a step skipped on NaN/inf, the batch's figures
    chunked_completion_logp    completion_logp's values without its [batch, max_len, vocab] logits

Nothing of the method is only here. For a model with a vocabulary of 32,000 tokens or more (a real
one: SmolLM2, Llama, Qwen), train.py's update_step takes its log pi_theta from
chunked_completion_logp below (--logp-chunk, its logp_fn): completion_logp's values, tested equal,
computed a chunk of tokens at a time so that the vocabulary's logits do not fill memory. The demo
model's vocabulary is 50 tokens: `python train.py` runs completion_logp itself.
"""
from __future__ import annotations

import functools
import math

import torch

from buffer import Rollout, collate
import replay_rl
from replay_rl import (batch_loss, check_layout, check_temperature, completion_logp, masked_mean,
                       refuse_active_dropout)

# update_step_engineered's loss_scale for float16 base weights (static)
FP16_LOSS_SCALE = 2.0**10
# Tokens per chunk of chunked_completion_logp (train.py's --logp-chunk): with a 152k vocabulary its
# two fp32 [chunk, vocab] tensors are 0.3 GB, and a chunk is still a large matmul for a GPU.
LOGP_CHUNK = 256
# --logp-chunk's default, -1, chunks the log-probs only for a vocabulary of this many tokens or more
# (Llama 2's 32,000 and up): below it the logits are small and completion_logp itself runs.
LARGE_VOCAB = 32_000
# Architectures whose causal LM computes its logits as lm_head(h) and nothing more (no soft cap, no
# scale): chunked_completion_logp applies the head itself, so it takes only these.
PLAIN_HEAD_MODELS = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3",
                     "olmo2", "smollm3")


def needed(cfg, world_size: int = 1) -> bool:
    """Whether a run needs update_step_engineered: micro-batches smaller than B, float16 base
    weights, or several processes (torchrun)."""
    return (0 < cfg.micro_batch_size < cfg.batch_size or cfg.dtype == "float16"
            or world_size > 1)


def engineered_step(cfg):
    """update_step_engineered with the run's micro-batch size and float16 loss scale bound, called
    as replay_rl.update_step is (the same arguments). train.py takes it where ``needed`` says."""
    micro = cfg.micro_batch_size if 0 < cfg.micro_batch_size < cfg.batch_size else 0
    return functools.partial(update_step_engineered, micro_batch_size=micro,
                             loss_scale=FP16_LOSS_SCALE if cfg.dtype == "float16" else 1.0)


def resolve_logp_chunk(chunk: int, model) -> int:
    """train.py's --logp-chunk as it runs: a chunk given (or 0) as it is; the default -1 is
    LOGP_CHUNK for a vocabulary of LARGE_VOCAB tokens or more, else 0 (completion_logp)."""
    if chunk != -1:
        return chunk
    vocab = model.get_output_embeddings().weight.shape[0]
    return LOGP_CHUNK if vocab >= LARGE_VOCAB else 0


def logp_fn(chunk: int):
    """The function update_step takes log pi_theta with (its logp_fn): completion_logp (None) for
    chunk 0, else chunked_completion_logp with ``chunk`` tokens at a time (train.py's
    --logp-chunk): the same values, without the [batch, max_len, vocab] logits."""
    return functools.partial(chunked_completion_logp, chunk=chunk) if chunk else None


# ---- Engineering: the same step in micro-batches, over processes, in fp16, skipping NaN ----
def update_step_engineered(model, optimizer, rollouts: list[Rollout], *, pad_id: int,
                           eos_ids: list[int], current_version: int, temperature: float = 1.0,
                           beta: float = 0.0, normalization: str = "token_mean",
                           micro_batch_size: int = 0, max_grad_norm: float = 1.0,
                           loss_scale: float = 1.0, logp_fn=None, **loss_args) -> dict:
    """update_step (the same gradient, the same optimizer step) with what train.py needs besides:
    - micro-batches of ``micro_batch_size`` rollouts (gradient accumulation): each micro-batch's
      loss is divided by the whole batch's tokens (token_mean) or sequences (sequence_mean),
      policy_loss's num_items_in_batch, so the accumulated gradient is the whole batch's;
    - under torchrun each process passes its share of the batch; the step and the metrics are
      those of the whole batch, the same on every process, at three collectives a step: the
      batch's counts, the gradients with the metric sums, the maxima;
    - loss_scale, for float16 base weights (FP16_LOSS_SCALE): backward runs on loss_scale * L and
      the gradients are divided by loss_scale before clipping, the same step; in between, the
      gradients of the fp16 activations are loss_scale times larger, so the small ones do not
      underflow to 0 (fp16's smallest normal is 6e-5). One that overflows is inf: the step is
      skipped;
    - a step whose loss or gradient is not finite is skipped, as in update_step;
    - the batch's figures: the loss's metrics, the entropy, the ages and uses of its rollouts;
    - logp_fn: as update_step's (logp_fn(chunk): chunked_completion_logp, the logits' memory
      bounded by the chunk, not by micro-batch x length x vocab).
    It is longer than the rest: one loop holds all of the above, and a first reading skips it.
    """
    refuse_active_dropout(model)
    if not max_grad_norm > 0:       # clip_grad_norm_ at 0 scales every gradient to 0, silently
        raise ValueError(f"max_grad_norm {max_grad_norm}: must be > 0 (float('inf'): no clip)")
    device = next(model.parameters()).device
    micro = micro_batch_size or len(rollouts)
    ages = [current_version - rollout.policy_version for rollout in rollouts]
    total_tokens, total_sequences, age_sum, uses_sum = _over_processes(torch.tensor(
        [sum(len(rollout.completion_ids) for rollout in rollouts), len(rollouts), sum(ages),
         sum(rollout.uses for rollout in rollouts)], dtype=torch.float64)).tolist()
    # Metrics add up on the device, read once at the end: each read of a GPU value makes the
    # host wait until the GPU is idle, and the next forward then starts from an idle GPU.
    names = (["loss", "is_ratio_mean", "is_truncated_frac", "approx_kl", "entropy"]
             + (["ref_kl"] if beta > 0 else []))
    sums = torch.zeros(len(names), dtype=torch.float64, device=device)
    ratio_max = torch.zeros((), device=device)
    # the divisor of every micro-batch's loss: the whole batch's (policy_loss's num_items_in_batch)
    count = total_tokens if normalization == "token_mean" else total_sequences
    optimizer.zero_grad(set_to_none=True)
    for i in range(0, len(rollouts), micro):
        chunk = rollouts[i:i + micro]
        cols = collate(chunk, pad_id, current_version, device=device, eos_ids=eos_ids)
        loss, m, entropy = batch_loss(model, cols, temperature=temperature, beta=beta,
                                      normalization=normalization, logp_fn=logp_fn,
                                      num_items_in_batch=count, **loss_args)
        (loss * loss_scale).backward()
        # the figures: token means in every normalization; loss and ref_kl add up as they come
        token_share = sum(len(rollout.completion_ids) for rollout in chunk) / total_tokens
        with torch.no_grad():
            sums += torch.stack([loss, m["is_ratio_mean"] * token_share,
                                 m["is_truncated_frac"] * token_share, m["approx_kl"] * token_share,
                                 masked_mean(entropy, cols["completion_mask"]) * token_share]
                                + ([m["ref_kl"]] if beta > 0 else [])).double()
            ratio_max = torch.maximum(ratio_max, m["is_ratio_max"])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sums = _unscale_and_sum_gradients(params, sums, loss_scale)
    maxima = _over_processes(torch.stack([ratio_max.double(),
                                          torch.tensor(float(max(ages)), device=device,
                                                       dtype=torch.float64)]), "max")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    *values, ratio_max, age_max, grad_norm = torch.cat([sums, maxima,
                                                        grad_norm.to(sums)[None]]).tolist()
    metrics = dict(zip(names, values))
    skipped = _step_unless_not_finite(optimizer, metrics["loss"], grad_norm)
    # uses_mean: the uses of this batch's rollouts so far, this one included (a rollout replayed
    # twice counts 2 here); the run's "each used y times" is rollouts trained / stored instead
    return {**metrics, "skipped": int(skipped), "is_ratio_max": ratio_max, "grad_norm": grad_norm,
            "age_mean": age_sum / total_sequences, "age_max": age_max,
            "uses_mean": uses_sum / total_sequences}


def _unscale_and_sum_gradients(params, sums: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """Divide the gradients by the loss scale; under torchrun replace each by its sum over the
    processes (data parallel), the metric sums travelling with it (in its float32). Returns the
    sums."""
    if loss_scale != 1.0:       # unscaled: the gradient of the loss itself (LoRA weights are fp32)
        for p in (p for p in params if p.grad is not None):
            p.grad.div_(loss_scale)
    if not torch.distributed.is_initialized():
        return sums
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _over_processes(torch.cat([g.flatten().float() for g in grads] + [sums.float()]))
    for p, g in zip(params, flat[:-len(sums)].split([g.numel() for g in grads])):
        p.grad = g.view_as(p).to(p.dtype, copy=True)
    return flat[-len(sums):].double()


def _step_unless_not_finite(optimizer, loss: float, grad_norm: float) -> bool:
    """optimizer.step(), unless the loss or the gradient is NaN/inf: that would poison the weights
    and Adam's moments for good. Returns whether the step was skipped."""
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return skipped


def _over_processes(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """t summed (op "sum") or its "max" over the processes of a torchrun job (one all_reduce), as a
    new tensor; t itself in one process. (distributed.py reduces figures by name, as floats; the
    step's sums stay one tensor on its device, reduced in one call.)"""
    if not torch.distributed.is_initialized():
        return t
    t = t.clone()
    ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}
    torch.distributed.all_reduce(t, op=ops[op])
    return t


# ---- Engineering: completion_logp without the [batch, max_len, vocab] logits ----------
def chunked_completion_logp(model, cols: dict[str, torch.Tensor], temperature: float = 1.0,
                            chunk: int = LOGP_CHUNK):
    """completion_logp's (logp, entropy), [batch, max_len] each, with the logits of at most
    ``chunk`` tokens alive at a time instead of all batch x max_len of them.

    The decoder (the model without its lm_head) gives the hidden states h of the columns that score
    the completion tokens, one to their left as in completion_logp; _HeadLogp applies the lm_head
    and the log-softmax at the temperature to ``chunk`` real tokens at a time. Padding (mask 0) is
    not scored: logp and entropy are 0 there, where the loss and its figures mask them out anyway.
    A model whose logits are not lm_head(h) alone (an architecture not in PLAIN_HEAD_MODELS: a
    capped or scaled head) or whose lm_head trains gets completion_logp itself.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, got {chunk}")
    check_temperature(cols, temperature)
    check_layout(cols)
    refuse_active_dropout(model)
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = causal_lm.get_output_embeddings()
    if (getattr(causal_lm.config, "model_type", None) not in PLAIN_HEAD_MODELS
            or type(head) is not torch.nn.Linear
            or any(p.requires_grad for p in head.parameters())):
        return completion_logp(model, cols, temperature)
    max_len = cols["completion_mask"].shape[1]
    # use_cache=False: a training forward needs no cache of every layer's attention keys and values
    hidden = causal_lm.get_decoder()(
        input_ids=cols["input_ids"][:, :-1], attention_mask=cols["attention_mask"][:, :-1],
        position_ids=cols["position_ids"][:, :-1], use_cache=False).last_hidden_state
    real = cols["completion_mask"].bool()                            # [batch, max_len]
    tokens = cols["input_ids"][:, -max_len:][real]            # o_t, [n] real tokens
    logp, entropy = _HeadLogp.apply(hidden[:, -max_len:][real], head.weight, head.bias,
                                    tokens, temperature, chunk)      # [n] each
    zeros = torch.zeros(real.shape, device=logp.device)
    return zeros.masked_scatter(real, logp), zeros.masked_scatter(real, entropy)


class _HeadLogp(torch.autograd.Function):
    """log pi_theta(o_t) and the entropy of n tokens from their hidden states, ``chunk`` at a time.

    h: [n, hidden], weight: the lm_head's [vocab, hidden] (bias: its own or None), o: [n] tokens,
    T the temperature.  u = (weight h + bias) / T;  p = softmax(u);
    log pi(o) = u_o - log sum_v exp(u_v);  H = log sum_v exp(u_v) - sum_v p_v u_v.
    The gradient of log pi(o_t) with respect to h_t is
        d log pi(o_t) / d h_t = weight^T (e_o - p) / T          (e_o: the one-hot of o_t)
    one vector of the hidden size per token. So the forward keeps that ([n, hidden]) instead of
    the logits, and the backward is grad_h_t = grad_logp_t * it: nothing of [n, vocab] is kept or
    recomputed, and the matmuls are those of the plain path (the head's forward and its backward
    to h). The head gets no gradient (chunked_completion_logp passes only frozen ones).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature: float, chunk: int):
        if any(ctx.needs_input_grad[1:3]):
            raise ValueError("_HeadLogp gives the lm_head no gradient: pass a frozen head, or take "
                             "log pi_theta with completion_logp")
        logp, entropy, grad_dirs = [], [], []
        for start in range(0, len(hidden), chunk):
            o = tokens[start:start + chunk, None]                              # [c, 1]
            u = torch.nn.functional.linear(hidden[start:start + chunk], weight, bias).float()
            if temperature != 1.0:
                u.div_(temperature)         # in place: u is this chunk's own tensor  [c, vocab]
            # from here u holds u - max_v u_v (in place, as logsumexp shifts): the same log-probs
            u.sub_(u.max(-1, keepdim=True).values)
            p = u.exp()
            sum_exp = p.sum(-1, keepdim=True)
            p.div_(sum_exp)                                                  # softmax, [c, vocab]
            log_sum_exp = sum_exp.log().squeeze(-1)          # of the shifted u: log pi = u_o - it
            logp.append(u.gather(-1, o).squeeze(-1) - log_sum_exp)
            entropy.append(log_sum_exp - torch.einsum("cv,cv->c", p, u))
            del u                           # two [c, vocab] fp32 tensors at most are alive at once
            if ctx.needs_input_grad[0]:
                p.scatter_add_(-1, o, torch.full_like(o, -1, dtype=p.dtype))      # p - e_o
                grad_dirs.append(torch.mm(p.to(weight.dtype), weight))     # weight^T (p - e_o)
            del p                           # before the next chunk's u is made
        logp, entropy = torch.cat(logp), torch.cat(entropy)
        ctx.mark_non_differentiable(entropy)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(torch.cat(grad_dirs))                    # [n, hidden]
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        (grad_dirs,) = ctx.saved_tensors
        # grad_h = grad_logp * weight^T (e_o - p) / T; the minus sign turns (p - e_o) around
        grad_hidden = grad_dirs.float() * (grad_logp / -ctx.temperature)[:, None]
        return grad_hidden.to(grad_dirs.dtype), None, None, None, None, None
