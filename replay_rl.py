"""The off-policy policy-gradient loss and the update step: log pi_theta, the loss, one step.

    loss_type "tis" (default), truncated importance sampling, token level:
        rho_t = pi_theta(o_t) / mu(o_t)          mu = the policy that generated the rollout
        w_t   = min(rho_t, C)                    C = is_cap, no gradient through w_t
        L     = - sum_t w_t * A * log pi_theta(o_t)       (normalized, see below)
    loss_type "ppo", the clipped GRPO/PPO objective with mu as the "old" policy:
        L     = - sum_t min(rho_t * A, clip(rho_t, 1 - epsilon, 1 + epsilon) * A)
    loss_type "asymre", asymmetric REINFORCE, no importance ratio at all:
        L     = - sum_t (r - (V - tau)) * log pi_theta(o_t)      V = the baseline, the group's mean
        policy_loss takes r and V as ``reward`` and ``baseline``, not the group-normalized A.
        tau > 0 favours what went right over what went wrong.
    normalization "token_mean": divide by the number of completion tokens in the batch.
                  "sequence_mean": average over tokens within a sequence, then over sequences.
    beta > 0 adds beta * KL(pi_theta || pi_ref) to any of them. pi_ref is the base model, with its
    adapter off.
With rho = 1 (fresh, on-policy data), tis and ppo both reduce to the plain policy gradient
-A * grad log pi. o_t is the t-th completion token. The symbols are those of the README's table.

Read in this order:
  - completion_logp: log pi_theta.
  - policy_loss: the formulas above.
  - update_step: one optimizer step (collate, batch_loss, backward, clip, step).
Below them, after a marker line, come the guards that each of them runs on its arguments. The
module needs torch and buffer.py (Rollout, collate), nothing else. The engineering that changes
nothing of the method (micro-batches, processes, fp16, log-probs in chunks) is in
infra/engineered_update.py. Loading a model with LoRA is in infra/policy.py.
"""
from __future__ import annotations

import torch

from buffer import Rollout, collate

LOSS_TYPES = ("tis", "ppo", "asymre")
NORMALIZATIONS = ("token_mean", "sequence_mean")
# Below this sampling temperature, mu is greedy in effect. At T = 0.01 a logit gap of 0.2 already
# gives the sampled token a probability of 1 - 2e-9. So log mu = 0, rho = 1, and the loss and its
# gradient vanish. completion_logp refuses such a T.
MIN_TEMPERATURE = 0.01


# ---- log pi_theta -----------------------------------------------------------------------------
def completion_logp(model, cols: dict[str, torch.Tensor], temperature: float = 1.0):
    """log pi_theta(o_t | o_<t) of every completion column, and the policy's entropy there.

    cols come from ``collate``: input_ids [batch, prompt_len + max_len] and completion_mask
    [batch, max_len], where max_len is the batch's longest completion. The logits at column j
    predict token j + 1. So the completion tokens (columns prompt_len .. prompt_len + max_len - 1)
    are scored by the logits one column to their left. Only those max_len columns are computed.
    The logits z are divided by the sampling temperature T, as they were when mu sampled. Rollouts
    that record another T raise.
        log pi_theta(o_t) = log softmax(z_t / T)[o_t] = z_t[o_t] / T - log sum exp(z_t / T)
    Returns logp [batch, max_len] (with gradient) and entropy [batch, max_len] (no gradient).
    A model in training mode with dropout on is refused (refuse_active_dropout). Its log-probs
    would be of another, random function than the one that sampled.
    `python train.py` (the demo) runs this function. For a real model's vocabulary (32,000 tokens
    or more), train.py hands update_step another function (--logp-chunk, logp_fn):
    chunked_completion_logp in infra/engineered_update.py. It gives these values (tested within
    1e-5) without the [batch, max_len, vocab] logits. With such a vocabulary those logits take
    gigabytes.
    """
    check_temperature(cols, temperature)
    check_layout(cols)
    refuse_active_dropout(model)
    max_len = cols["completion_mask"].shape[1]
    # The last column is not fed. Its logits would predict a token after the sequence, and under
    # the causal mask no other column depends on it. logits_to_keep=max_len keeps the logits of
    # the last max_len columns fed: those that score the completion's tokens.
    out = model(input_ids=cols["input_ids"][:, :-1], attention_mask=cols["attention_mask"][:, :-1],
                position_ids=cols["position_ids"][:, :-1], logits_to_keep=max_len)
    z = out.logits.float()                                   # [batch, max_len, vocab]
    scaled = z / temperature if temperature != 1.0 else z   # z / T; no copy at T = 1 (memory)
    tokens = cols["input_ids"][:, -max_len:]
    log_sum_exp = torch.logsumexp(scaled, dim=-1)            # [batch, max_len]
    logp = scaled.gather(-1, tokens[..., None]).squeeze(-1) - log_sum_exp
    with torch.no_grad():
        # H = log_sum_exp - sum over the vocabulary of softmax(z / T) * z / T. A batched dot
        # product computes it without a third [batch, max_len, vocab] tensor.
        entropy = log_sum_exp - torch.einsum("bcv,bcv->bc", torch.softmax(scaled, -1), scaled)
    return logp, entropy


# ---- the loss -----------------------------------------------------------------------------------
def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantage: torch.Tensor | None,
                mask: torch.Tensor, *, loss_type: str = "tis", is_cap: float = 2.0,
                epsilon: float = 0.2, normalization: str = "token_mean",
                ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                reward: torch.Tensor | None = None, baseline: torch.Tensor | None = None,
                asymre_tau: float = 0.1, num_items_in_batch: int | None = None):
    """The off-policy policy-gradient loss of the module docstring. Returns (loss, metrics).

    logp, behaviour_logp, mask: [batch, max_len]. logp must be log softmax(z_t / T) at the T mu
    sampled at, as behaviour_logp is (completion_logp checks the rollouts' T; this function cannot:
    at another T, rho != 1 on fresh data, silently). mask: 1 on each completion token, its EOS
    included, as collate makes it (by length). A mask of ``ids != pad_id`` drops the EOS when
    pad == eos, and the model never learns to stop. advantage A: [batch], one per rollout. asymre
    takes reward r and baseline V [batch] instead. is_cap = C, the cap of the importance sampling
    ("is_") weight. log mu is data, so it is detached here. A behaviour_logp that still carries a
    graph (from a forward run without torch.no_grad) gets no gradient through the ratio.
    beta > 0 adds beta * KL to the reference log-probs ref_logp [batch, max_len]. Per token,
    kl_t = exp(d_t) - d_t - 1, with d_t = log pi_ref(o_t) - log pi_theta(o_t). This is GRPO's
    estimate of KL(pi_theta || pi_ref). It is exact in expectation over tokens drawn from
    pi_theta. Here the tokens were drawn from mu (stale, on replay), and the term is not
    importance-weighted, so it is an approximation.
    Gradient accumulation: the mean of the micro-batches' losses is not the batch's loss, because
    token_mean weighs every token alike, not every micro-batch. Pass each micro-batch
    num_items_in_batch, the whole batch's tokens (token_mean) or rollouts (sequence_mean), and sum
    the losses."""
    if is_cap < 1:
        raise ValueError(f"is_cap {is_cap}: C must be >= 1 (a cap below 1 cuts fresh tokens too)")
    if not 0 < epsilon < 1:
        raise ValueError(f"epsilon {epsilon}: ppo's clip range must be in (0, 1)")
    if beta < 0 or (beta > 0 and ref_logp is None):
        raise ValueError(f"beta {beta}: must be >= 0, and > 0 needs ref_logp")
    if behaviour_logp.shape != logp.shape or mask.shape != logp.shape:    # else they broadcast
        raise ValueError(f"logp {list(logp.shape)}, behaviour_logp {list(behaviour_logp.shape)} "
                         f"and mask {list(mask.shape)} must be one [batch, max_len] each: log mu "
                         "of each token (not a sequence's), as collate gives it")
    # the advantage each token is weighed by, [batch, 1]: A for tis and ppo (ppo: times rho),
    # r - (V - tau) for asymre. A constant: no gradient reaches A, r or V (a critic's baseline or
    # a differentiable reward passed in would otherwise be trained by this loss)
    term = advantage_term(advantage, logp, loss_type, reward, baseline, asymre_tau).detach()
    real = mask > 0         # to select (torch.where), never to multiply: NaN * 0 is NaN
    logp = torch.where(real, logp, 0.0)
    behaviour_logp = torch.where(real, behaviour_logp.detach(), 0.0)
    log_rho = logp - behaviour_logp
    rho = torch.exp(log_rho)                                      # rho_t, [batch, max_len]
    if loss_type == "tis":
        w = rho.detach().clamp(max=is_cap)                        # w_t = min(rho_t, C): no gradient
        per_token = -w * term * logp
    elif loss_type == "ppo":
        per_token = -torch.minimum(rho * term, rho.clamp(1 - epsilon, 1 + epsilon) * term)
    else:                                                         # asymre: no ratio at all
        per_token = -term * logp
    loss = masked_mean(per_token, mask, normalization, num_items_in_batch)
    kl = None
    if beta > 0:
        d = torch.where(real, ref_logp, 0.0) - logp
        kl = masked_mean(torch.exp(d) - d - 1, mask, normalization, num_items_in_batch)
        loss = loss + beta * kl
    return loss, loss_metrics(rho, log_rho, term, real, loss_type, is_cap, epsilon, kl)


def advantage_term(advantage, logp, loss_type: str, reward=None, baseline=None,
                   asymre_tau: float = 0.1):
    """Each rollout's weight of the policy-gradient term, as [batch, 1]. For tis and ppo it is
    the advantage A. For asymre it is r - (V - tau), which is not the group-normalized A. Anything
    but one value per rollout raises. A per-token [batch, max_len] would broadcast against logp to
    [batch, batch, max_len] and give a wrong loss without an error."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}, expected one of {LOSS_TYPES}")
    if loss_type == "asymre":
        if reward is None or baseline is None:
            raise ValueError("loss_type 'asymre' weighs log pi by r - (V - tau), not by the "
                             "group-normalized advantage: pass reward and baseline (V, the mean "
                             "reward of each rollout's group)")
        term = reward - (baseline - asymre_tau)
    else:
        term = advantage
    if term is None or term.shape != logp.shape[:1]:
        raise ValueError(f"the advantage (asymre: reward and baseline) must have shape [batch] = "
                         f"{list(logp.shape[:1])}, one value per rollout; got "
                         f"{None if term is None else list(term.shape)}")
    return term[:, None]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, normalization: str = "token_mean",
                num_items_in_batch: int | None = None) -> torch.Tensor:
    """The mean of x [batch, max_len] over the real tokens (mask 1).
    token_mean: the sum over every token of the batch, divided by the batch's tokens. The tokens
    of rollouts with A = 0 count in the denominator, though they add nothing to the sum. So when
    most of a batch's groups are all-equal, the step is several times smaller than over the other
    tokens alone. This is DAPO's token-level convention, and the lr absorbs it (the GRPO paper's is
    sequence_mean).
    sequence_mean: the mean within each sequence, then over the sequences.
    num_items_in_batch: for x that is one micro-batch of a larger batch. It is that batch's tokens
    (token_mean) or sequences (sequence_mean), and it replaces this micro-batch's own divisor.
    The micro-batches' results then add up to the batch's mean."""
    x = torch.where(mask > 0, x, 0.0)       # not x * mask: a NaN or inf at padding would poison it
    if normalization == "token_mean":
        return x.sum() / (num_items_in_batch or mask.sum().clamp(min=1))
    if normalization == "sequence_mean":
        return (x.sum(1) / mask.sum(1).clamp(min=1)).sum() / (num_items_in_batch or len(x))
    raise ValueError(f"unknown normalization {normalization!r}, expected one of {NORMALIZATIONS}")


@torch.no_grad()
def loss_metrics(rho, log_rho, term, real, loss_type: str, is_cap: float, epsilon: float,
                 kl=None) -> dict:
    """Figures of one loss over the real tokens (``real`` is the mask as booleans). They are 0-dim
    tensors, because reading one (float(), .item()) waits for a GPU: update_step reads them all
    at once, after the step; the engineered step adds them over micro-batches first.
      is_ratio_mean, is_ratio_max: of rho.
      is_truncated_frac: the fraction of tokens whose weight was cut to the cap C (tis), or whose
        clipped term was active (ppo).
      approx_kl = mean((rho - 1) - log rho): an unbiased estimate of KL(mu || pi_theta).
      ref_kl: the KL term (with beta > 0)."""
    rho = rho.detach()
    if loss_type == "tis":
        cut = rho > is_cap
    elif loss_type == "ppo":
        cut = rho.clamp(1 - epsilon, 1 + epsilon) * term < rho * term
    else:
        cut = torch.zeros_like(real)
    tokens = real.sum().clamp(min=1)
    over_real = lambda x: torch.where(real, x, 0.0).sum() / tokens      # noqa: E731
    metrics = {"is_ratio_mean": over_real(rho),
               "is_ratio_max": rho.masked_fill(~real, 0).max(),
               "is_truncated_frac": over_real(cut.float()),
               "approx_kl": over_real(rho - 1 - log_rho.detach())}
    if kl is not None:
        metrics["ref_kl"] = kl.detach()
    return metrics


# ---- one optimizer step -------------------------------------------------------------------------
def batch_loss(model, cols: dict[str, torch.Tensor], *, temperature: float = 1.0, beta: float = 0.0,
               logp_fn=None, **loss_args):
    """policy_loss of the model on collated rollouts. Returns (loss, metrics, entropy [batch,
    max_len]). The reference policy of the KL term (beta > 0) is the base model: the same weights,
    with the adapter off. logp_fn is the function that gives (logp, entropy). None means
    completion_logp. Any other must take the same arguments and give the same values
    (infra/engineered_update.py's chunked_completion_logp)."""
    if beta > 0 and not hasattr(model, "disable_adapter"):
        raise ValueError(f"beta {beta} > 0: the KL term's reference is the model with its adapter "
                         "off (disable_adapter), only a PEFT model has one; wrap it or pass beta 0")
    logp_fn = logp_fn or completion_logp
    logp, entropy = logp_fn(model, cols, temperature)
    ref_logp = None
    if beta > 0:
        with torch.no_grad(), model.disable_adapter():
            ref_logp, _ = logp_fn(model, cols, temperature)
    loss, metrics = policy_loss(logp, cols["behaviour_logp"], cols["advantage"],
                                cols["completion_mask"], ref_logp=ref_logp, beta=beta,
                                reward=cols["reward"], baseline=cols["baseline"], **loss_args)
    return loss, metrics, entropy


def update_step(model, optimizer, rollouts: list[Rollout], *, pad_id: int, eos_ids: list[int],
                current_version: int, temperature: float = 1.0, beta: float = 0.0,
                max_grad_norm: float = 1.0, logp_fn=None, **loss_args) -> dict:
    """One optimizer step on a batch of rollouts. It runs one forward over the batch at the
    sampling temperature and takes the loss against the stored behaviour log-probs. Then it runs
    backward, clips the gradient and steps. A step whose loss or gradient is NaN/inf is skipped
    (metrics["skipped"] = 1). The model must compute the function that sampled. So with dropout
    active in training mode, completion_logp refuses (rho != 1 even on fresh data).
    pad_id, eos_ids: collate's (rollout.end_token_ids gives them).
    current_version: the policy's optimizer steps so far, a skipped NaN/inf step included. Each
    rollout's age is current_version minus its own policy_version.
    loss_args: policy_loss's (loss_type, is_cap, epsilon, normalization, asymre_tau).
    logp_fn: batch_loss's.
    train.py runs this step. infra/engineered_update.py takes the same step in micro-batches, over
    processes or in fp16, when a flag asks for one. Tests keep the two equal.
    """
    if not max_grad_norm > 0:       # clip_grad_norm_ at 0 scales every gradient to 0, silently
        raise ValueError(f"max_grad_norm {max_grad_norm}: must be > 0 (float('inf'): no clip)")
    cols = collate(rollouts, pad_id, current_version, device=next(model.parameters()).device,
                   eos_ids=eos_ids)
    loss, metrics, entropy = batch_loss(model, cols, temperature=temperature, beta=beta,
                                        logp_fn=logp_fn, **loss_args)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # The clip guards against a rare huge step (one batch of unlucky ratios). It is not the method.
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    # A NaN/inf step would poison the weights and AdamW's moments for good, so skip it.
    skipped = not (torch.isfinite(loss) and torch.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    return {"loss": loss.item(), **{k: v.item() for k, v in metrics.items()},
            "grad_norm": grad_norm.item(), "skipped": int(skipped),
            "entropy": masked_mean(entropy, cols["completion_mask"]).item(),
            "age_mean": cols["age"].mean().item(), "age_max": cols["age"].max().item(),
            "uses_mean": sum(rollout.uses for rollout in rollouts) / len(rollouts)}


# ---- the guards: each function above refuses, in one line, what would make it silently wrong ----
def check_layout(cols: dict) -> None:
    """Refuses, in one line, cols that are not laid out as ``collate``'s, which completion_logp
    reads. That layout is input_ids, attention_mask, position_ids [batch, prompt_len + max_len]
    and completion_mask [batch, max_len]. The prompts are padded on the left, the completions fill
    the last max_len columns, padded on the right. Cols of another layout with the same shapes (a
    row-wise right-padded batch) would be scored at the wrong columns, silently."""
    need = ("input_ids", "attention_mask", "position_ids", "completion_mask")
    shapes = {k: tuple(cols[k].shape) for k in need if torch.is_tensor(cols.get(k))}
    whole, completion = shapes.get("input_ids", ()), shapes.get("completion_mask", ())
    if (len(shapes) < len(need) or len(whole) != 2 or len(completion) != 2
            or completion[0] != whole[0] or not 0 < completion[1] < whole[1]
            or shapes["attention_mask"] != whole or shapes["position_ids"] != whole):
        raise ValueError(f"cols are not collate's layout: {shapes} (needs {need}, the completions "
                         "the last max_len of input_ids' columns): build them with buffer.collate")
    # where the tokens are: each completion starts in the first of the last max_len columns and is
    # padded on its right, so those columns are attended exactly where completion_mask is 1; each
    # prompt ends in the column before them (padded on its left)
    max_len = completion[1]
    attention = cols["attention_mask"]
    if (not torch.equal(attention[:, -max_len:].bool(), cols["completion_mask"].bool())
            or not attention[:, -max_len - 1].bool().all()):
        raise ValueError("cols are not collate's layout: the prompts must be padded on the left "
                         "and the completions fill the last max_len columns, padded on the right "
                         "(their attention_mask there equal to completion_mask): build them with "
                         "buffer.collate")
    # positions count real tokens only, as generate numbers them under left padding (a model
    # with learned positions scores other positions otherwise; rotary ones shift alike)
    if not torch.equal(cols["position_ids"], (attention.long().cumsum(1) - 1).clamp(min=0)):
        raise ValueError("cols' position_ids are not collate's (the real tokens counted from 0 "
                         "in each row): build them with buffer.collate")


def check_temperature(cols: dict, temperature: float) -> None:
    """Refuses a T at which log pi_theta would not be comparable with the stored log mu. That is a
    T other than the rollouts' (collate records theirs in cols), or one too low to sample at all."""
    if "temperature" not in cols:
        raise ValueError("cols has no 'temperature': collate records the T the rollouts were "
                         "sampled at, and log pi_theta must be taken at that T")
    sampled_at = cols["temperature"]
    if temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature {temperature:g} < {MIN_TEMPERATURE}: sampling is greedy in "
                         "effect there (log mu = 0 for every sampled token), so the loss is 0")
    if sampled_at != temperature:
        raise ValueError(f"the rollouts were sampled at temperature {sampled_at:g} but "
                         f"log pi_theta is taken at {temperature:g}: pass the sampling "
                         "temperature, else every importance ratio is wrong")


DROPOUT_WORDS = ("dropout", "pdrop", "layerdrop", "jitter")


def dropout_rates(model):
    """Every rate of randomness that the model applies in training mode only, as (where, owner,
    attribute, rate). There are three kinds:
      - the p of any torch dropout module (Dropout, Dropout1d-3d, AlphaDropout and the like: every
        subclass of torch's _DropoutNd);
      - the float attributes that layers pass to F.dropout themselves (attention_dropout in
        Llama/Qwen, OPT's dropout, layerdrop), and a mixture of experts' router jitter
        (Mixtral's jitter_noise);
      - the rates that layers read from their config during the forward (Falcon's hidden_dropout,
        GPT-Neo's attention_dropout), in every config the model's modules hold, including a
        model's text_config.
    They are found by name. A layer that adds noise in training mode under another name is missed.
    """
    configs = {}
    for name, module in model.named_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, float) and (
                    (attr == "p" and isinstance(module, torch.nn.modules.dropout._DropoutNd))
                    or any(word in attr.lower() for word in DROPOUT_WORDS)):
                yield name, module, attr, value
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            configs.setdefault(id(config), (f"{name or 'model'}.config", config))
    while configs:
        _, (where, config) = configs.popitem()
        for attr, value in list(vars(config).items()):
            if hasattr(value, "to_dict"):                       # a sub-config (text_config)
                configs.setdefault(id(value), (f"{where}.{attr}", value))
            elif isinstance(value, float) and any(w in attr.lower() for w in DROPOUT_WORDS):
                yield where, config, attr, value


def refuse_active_dropout(model) -> None:
    """Refuses a model in training mode with a dropout (or router jitter) rate above 0, as found
    by dropout_rates. Its forward would be random: another function than the one that sampled
    (rho != 1 on fresh data), or than the one a greedy eval should score. model.eval() turns every
    such rate off. infra/policy.py's load_policy sets every rate to 0."""
    training = any(module.training for module in model.modules())
    for where, owner, attr, rate in dropout_rates(model):
        active = owner.training if isinstance(owner, torch.nn.Module) else training
        if active and rate > 0:
            raise ValueError(f"the model is in training mode with active dropout ({where}.{attr}: "
                             f"{rate:g}): its forward would differ from the one that sampled "
                             "(rho != 1); call model.eval(), or set the rate to 0")
