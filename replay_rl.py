"""The policy (a causal LM with LoRA), the off-policy policy-gradient loss and the update step.

    loss_type "tis" (default), truncated importance sampling, token level:
        rho_t = pi_theta(o_t) / mu(o_t)          mu = the policy that generated the rollout
        w_t   = min(rho_t, C)                    C = is_cap, no gradient through w_t
        L     = - sum_t w_t * A * log pi_theta(o_t)       (normalized, see below)
    loss_type "ppo", the clipped GRPO/PPO objective with mu as the "old" policy:
        L     = - sum_t min(rho_t * A, clip(rho_t, 1 - epsilon, 1 + epsilon) * A)
    loss_type "asymre", asymmetric REINFORCE, no importance ratio at all:
        L     = - sum_t (r - (V - tau)) * log pi_theta(o_t)      V = the baseline, the group's mean
        (policy_loss takes r and V as ``reward`` and ``baseline`` and forms the coefficient itself:
        not the group-normalized A; tau > 0 favours what went right over what went wrong)
    normalization "token_mean": divide by the number of completion tokens in the batch;
                  "sequence_mean": average over tokens within a sequence, then over sequences.
    beta > 0 adds beta * KL(pi_theta || pi_ref) to any of them
        (pi_ref: the base model, adapter off; not the metric approx_kl, KL(mu || pi_theta)).
With rho = 1 (fresh, on-policy data) tis and ppo both reduce to the plain policy gradient
-A * grad log pi.   (o_t: the t-th completion token; the symbols are the README's table.)

Read in this order: completion_logp (log pi_theta), policy_loss (the formulas above, with its
helpers log_pi_coefficient, masked_mean, loss_metrics), update_step (one plain optimizer step, its
loss from batch_loss: log pi_theta, and with beta > 0 the reference's, then policy_loss).
The engineering that changes nothing of the method lives in infra/engineered_update.py: the same
step in micro-batches, over processes, in fp16 (update_step_engineered), and completion_logp's
values without its [batch, max_len, vocab] logits (chunked_completion_logp).
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from buffer import Rollout, collate

LOSS_TYPES = ("tis", "ppo", "asymre")
NORMALIZATIONS = ("token_mean", "sequence_mean")
# Below this sampling temperature mu is greedy in effect: at T = 0.01 a logit gap of 0.2 already
# gives the sampled token a probability of 1 - 2e-9, so log mu = 0, rho = 1, and the loss and its
# gradient vanish. completion_logp refuses it.
MIN_TEMPERATURE = 0.01

def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The model's tokenizer, padding on the left (prompts for generate), with EOS as the pad token
    if it has none."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    # Engineering: AutoTokenizer picks the class from the model type (qwen2 -> Qwen2Tokenizer),
    # which rebuilds the pre-tokenizer: for a folder whose tokenizer.json is not Qwen's own (e.g. a
    # character vocabulary) that silently drops spaces. Then the tokenizer.json exactly as saved is
    # the right one.
    probe = "12 + 3 = 15"
    if tokenizer.decode(tokenizer.encode(probe, add_special_tokens=False)) != probe:
        from transformers import PreTrainedTokenizerFast
        try:
            saved = PreTrainedTokenizerFast.from_pretrained(name_or_path)
        except (OSError, ValueError):
            # no tokenizer.json (e.g. sentencepiece only): keep AutoTokenizer's
            saved = None
        if (saved is not None
                and saved.decode(saved.encode(probe, add_special_tokens=False)) == probe):
            tokenizer = saved
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def dropout_off(model) -> None:
    """Every dropout rate of the model set to 0, so that its training forward computes the
    distribution that sampled (rho = 1 on fresh data): nn.Dropout's p and the float attributes
    that layers pass to F.dropout themselves (attention_dropout; OPT's dropout; Falcon's
    hidden_dropout; layerdrop). rollout.dropout_rates finds the same ones (each file stands
    alone)."""
    for module in model.modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, float) and (
                    (attr == "p" and isinstance(module, torch.nn.Dropout))
                    or any(word in attr.lower() for word in ("dropout", "pdrop", "layerdrop"))):
                setattr(module, attr, 0.0)


def load_policy(name_or_path: str, *, lora_r: int = 16, lora_alpha: int | None = None,
                target_modules="all-linear", load_in_4bit: bool = False, device: str = "cpu",
                dtype: torch.dtype = torch.float32, gradient_checkpointing: bool = False,
                trust_remote_code: bool = False, tokenizer=None):
    """Load a Hugging Face causal LM (hub id or local folder) and wrap it with a fresh LoRA adapter.

    Returns (peft_model, tokenizer): pi_theta, with only the LoRA weights trainable. For exact
    importance ratios the model samples with only the settings rollout.py passes (the checkpoint's
    own generation defaults are dropped: rollout.py overrides or refuses them anyway) and without
    dropout, so on fresh data rho = 1.
    tokenizer: one from ``load_tokenizer`` (else loaded here). load_in_4bit: nf4 weights with
    double quantization, computing in ``dtype``. lora_alpha: None gives 2 * lora_r, so LoRA's
    scale lora_alpha / lora_r is 2 at any rank; train.py passes its --lora-alpha (default 32, a
    fixed number: scale 2 at its default lora_r 16, another at another rank).
    gradient_checkpointing: recompute activations in backward (less memory, ~30% more time).
    """
    from peft import LoraConfig, get_peft_model

    tokenizer = tokenizer or load_tokenizer(name_or_path, trust_remote_code)
    model = load_base_model(name_or_path, load_in_4bit=load_in_4bit, device=device, dtype=dtype,
                            gradient_checkpointing=gradient_checkpointing,
                            trust_remote_code=trust_remote_code)
    # Sampling must follow only the settings rollout.py passes: a checkpoint's shipped defaults
    # (Qwen-Instruct: repetition_penalty, top_k, temperature) would otherwise fill in the unset
    # fields of generate() and change the distribution behind the stored behaviour log-probs.
    # Only the end tokens are kept.
    model.generation_config = GenerationConfig(eos_token_id=model.generation_config.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    dropout_off(model)      # else the training forward differs from the sampling one (rho != 1)
    lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r if lora_alpha is None else lora_alpha,
                      lora_dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, lora), tokenizer


def load_base_model(name_or_path: str, *, load_in_4bit: bool, device: str, dtype: torch.dtype,
                    gradient_checkpointing: bool, trust_remote_code: bool):
    """The causal LM that load_policy wraps: 4-bit (nf4, prepared for k-bit training) or not, on
    ``device``, with gradient checkpointing if asked."""
    kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True)
    if load_in_4bit:
        from transformers import BitsAndBytesConfig
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if load_in_4bit:
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
        # Engineering: bitsandbytes on CPU repacks 4-bit weights after a no-grad forward (generate),
        # after which backward silently gives no LoRA gradients; this flag keeps the plain layout.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    else:
        model.to(device)
        if gradient_checkpointing:
            # Engineering: transformers renamed the method (and its keyword); the old name is
            # deprecated
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            # so checkpointed blocks see a tensor that needs grad
            model.enable_input_require_grads()
    return model


def completion_logp(model, cols: dict[str, torch.Tensor], temperature: float = 1.0):
    """log pi_theta(o_t | o_<t) of every completion column, and the policy entropy there.

    cols from ``collate``: input_ids [batch, prompt_len + max_len], completion_mask [batch, max_len]
    (max_len: the batch's longest completion). The logits at column j predict token j + 1, so the
    completion tokens (columns prompt_len .. prompt_len + max_len - 1) are scored by the logits one
    column to their left; only those max_len columns are materialized. The logits are divided by
    the sampling temperature T, as they were when mu sampled (rollouts that record another T raise).
    Returns logp [batch, max_len] (with gradient) and entropy [batch, max_len] (no gradient).
    """
    check_temperature(cols, temperature)
    check_layout(cols)
    max_len = cols["completion_mask"].shape[1]
    # The last column is not fed: its logits would predict a token after the sequence, and under
    # the causal mask no other column depends on it.
    out = model(input_ids=cols["input_ids"][:, :-1], attention_mask=cols["attention_mask"][:, :-1],
                position_ids=cols["position_ids"][:, :-1], logits_to_keep=max_len)
    # z: the logits (the README's z_t); u = z / T over the vocabulary v; p_v = softmax(u)_v, so
    # log pi_theta(o_t) = u_{o_t} - log_sum_exp, with log_sum_exp = log sum_v exp(u_v), and the
    # entropy H = - sum_v p_v log p_v = log_sum_exp - sum_v p_v u_v.
    z = out.logits.float()                                          # [batch, max_len, vocab]
    u = z / temperature if temperature != 1.0 else z                # engineering: no pass at T = 1
    tokens = cols["input_ids"][:, -max_len:]
    log_sum_exp = torch.logsumexp(u, dim=-1)                        # [batch, max_len]
    logp = u.gather(-1, tokens[..., None]).squeeze(-1) - log_sum_exp
    with torch.no_grad():
        # engineering: sum_v p_v u_v as a batched dot product, with no [batch, max_len, vocab]
        # product in between (each full-vocabulary pass costs as much as a small matmul)
        entropy = log_sum_exp - torch.einsum("bcv,bcv->bc", torch.softmax(u, -1), u)
    return logp, entropy


def check_layout(cols: dict) -> None:
    """Refuses, in one line, cols not laid out as ``collate``'s, which completion_logp reads:
    input_ids, attention_mask, position_ids [batch, prompt_len + max_len] and completion_mask
    [batch, max_len], the completions in the last max_len columns."""
    need = ("input_ids", "attention_mask", "position_ids", "completion_mask")
    shapes = {k: tuple(cols[k].shape) for k in need if torch.is_tensor(cols.get(k))}
    whole, completion = shapes.get("input_ids", ()), shapes.get("completion_mask", ())
    if (len(shapes) < len(need) or len(whole) != 2 or len(completion) != 2
            or completion[0] != whole[0] or not 0 < completion[1] < whole[1]
            or shapes["attention_mask"] != whole or shapes["position_ids"] != whole):
        raise ValueError(f"cols are not collate's layout: {shapes} (needs {need}, the completions "
                         "the last max_len of input_ids' columns): build them with buffer.collate")


def check_temperature(cols: dict, temperature: float) -> None:
    """Refuses a T at which log pi_theta would not be comparable with the stored log mu: another T
    than the rollouts' (collate records theirs in cols), or one too low to sample at all."""
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


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantage: torch.Tensor | None,
                mask: torch.Tensor, *, loss_type: str = "tis", is_cap: float = 2.0,
                epsilon: float = 0.2, normalization: str = "token_mean",
                ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                reward: torch.Tensor | None = None, baseline: torch.Tensor | None = None,
                asymre_tau: float = 0.1, num_items_in_batch: int | None = None):
    """The off-policy policy-gradient loss of the module docstring; returns (loss, metrics).

    logp, behaviour_logp, mask: [batch, max_len];  advantage A: [batch], one per rollout. asymre
    takes reward r and baseline V [batch] instead. coef: what multiplies log pi, A (tis, ppo) or
    r - (V - tau) (asymre).  is_cap = C: the cap of the importance sampling ("is_") weight.
    beta > 0: + beta * KL to the reference log-probs ref_logp [batch, max_len], per token
    kl_t = exp(d_t) - d_t - 1 with d_t = log pi_ref(o_t) - log pi_theta(o_t): GRPO's estimate of
    KL(pi_theta || pi_ref), exact in expectation over tokens drawn from pi_theta. Here they were
    drawn from mu (stale, on replay) and the term is not importance-weighted: an approximation.
    Gradient accumulation: the mean of micro-batches' losses is not the batch's loss (token_mean
    weighs every token alike, not every micro-batch). Pass each micro-batch num_items_in_batch,
    the whole batch's tokens (token_mean) or rollouts (sequence_mean), and sum the losses."""
    if is_cap < 1 or not 0 < epsilon < 1 or beta < 0 or (beta > 0 and ref_logp is None):
        raise ValueError(f"is_cap {is_cap} (>= 1: a cap below 1 cuts fresh tokens too), "
                         f"epsilon {epsilon} (in (0, 1)), beta {beta} (>= 0; > 0 needs ref_logp): "
                         "one is out of range")
    coef = log_pi_coefficient(advantage, logp, loss_type, reward, baseline, asymre_tau)
    real = mask > 0         # selects (torch.where), never multiplies: NaN * 0 at padding is NaN
    logp, behaviour_logp = torch.where(real, logp, 0.0), torch.where(real, behaviour_logp, 0.0)
    log_rho = logp - behaviour_logp
    rho = torch.exp(log_rho)                                      # rho_t, [batch, max_len]
    if loss_type == "tis":
        w = rho.detach().clamp(max=is_cap)                        # w_t = min(rho_t, C): no gradient
        per_token = -w * coef * logp
    elif loss_type == "ppo":
        per_token = -torch.minimum(rho * coef, rho.clamp(1 - epsilon, 1 + epsilon) * coef)
    else:                                                         # asymre: no ratio at all
        per_token = -coef * logp
    loss, kl = masked_mean(per_token, mask, normalization, num_items_in_batch), None
    if beta > 0:
        d = torch.where(real, ref_logp, 0.0) - logp
        kl = masked_mean(torch.exp(d) - d - 1, mask, normalization, num_items_in_batch)
        loss = loss + beta * kl
    return loss, loss_metrics(rho, log_rho, coef, mask, loss_type, is_cap, epsilon, kl)


def log_pi_coefficient(advantage, logp, loss_type: str, reward=None, baseline=None,
                       asymre_tau: float = 0.1):
    """What multiplies log pi_theta for each rollout, as [batch, 1]: the advantage A (tis, ppo), or
    asymre's r - (V - tau), which is not the group-normalized A. Anything but one value per rollout
    raises: a per-token [batch, max_len] would broadcast against logp to [batch, batch,
    max_len] and give a wrong loss without an error."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}, expected one of {LOSS_TYPES}")
    if loss_type == "asymre":
        if reward is None or baseline is None:
            raise ValueError("loss_type 'asymre' weighs log pi by r - (V - tau), not by the "
                             "group-normalized advantage: pass reward and baseline (V, the mean "
                             "reward of each rollout's group)")
        coef = reward - (baseline - asymre_tau)
    else:
        coef = advantage
    if coef is None or coef.shape != logp.shape[:1]:
        raise ValueError(f"the advantage (asymre: reward and baseline) must have shape [batch] = "
                         f"{list(logp.shape[:1])}, one value per rollout; got "
                         f"{None if coef is None else list(coef.shape)}")
    return coef[:, None]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, normalization: str = "token_mean",
                num_items_in_batch: int | None = None) -> torch.Tensor:
    """The mean of x [batch, max_len] over the real tokens (mask 1).
    token_mean: sum over every token of the batch / the batch's tokens. The tokens of rollouts with
    A = 0 count in the denominator though they add nothing to the sum: when most of a batch's
    groups are all-equal, the step is several times smaller than over the other tokens alone
    (GRPO's convention; the lr absorbs it). sequence_mean: the mean within each sequence, then
    over the sequences. num_items_in_batch: when x is one micro-batch of a larger batch, that
    batch's tokens (token_mean) or sequences (sequence_mean), the divisor in place of this one's:
    the micro-batches' results then add up to the batch's mean."""
    # not x * mask: a NaN or inf at padding would poison the sum
    x = torch.where(mask > 0, x, 0.0)
    if normalization == "token_mean":
        return x.sum() / (num_items_in_batch or mask.sum().clamp(min=1))
    if normalization == "sequence_mean":
        return (x.sum(1) / mask.sum(1).clamp(min=1)).sum() / (num_items_in_batch or len(x))
    raise ValueError(f"unknown normalization {normalization!r}, expected one of {NORMALIZATIONS}")


@torch.no_grad()
def loss_metrics(rho, log_rho, coef, mask, loss_type: str, is_cap: float, epsilon: float,
                 kl=None) -> dict:
    """Figures of one loss, as 0-dim tensors (reading one, float(), waits for a GPU: the caller
    decides when): is_ratio_mean / is_ratio_max of rho over real tokens; is_truncated_frac, the
    fraction of tokens whose weight was cut to the cap C (tis) or whose clipped term was active
    (ppo); approx_kl = mean((rho - 1) - log rho), an unbiased estimate of KL(mu || pi_theta);
    ref_kl, the KL term (with beta > 0)."""
    rho = rho.detach()
    if loss_type == "tis":
        cut = rho > is_cap
    elif loss_type == "ppo":
        cut = rho.clamp(1 - epsilon, 1 + epsilon) * coef < rho * coef
    else:
        cut = torch.zeros_like(mask, dtype=torch.bool)
    tokens = mask.sum().clamp(min=1)
    metrics = {"is_ratio_mean": (rho * mask).sum() / tokens,
               "is_ratio_max": rho.masked_fill(mask == 0, 0).max(),
               "is_truncated_frac": (cut.float() * mask).sum() / tokens,
               "approx_kl": ((rho - 1 - log_rho.detach()) * mask).sum() / tokens}
    if kl is not None:
        metrics["ref_kl"] = kl.detach()
    return metrics


def batch_loss(model, cols: dict[str, torch.Tensor], *, temperature: float = 1.0, beta: float = 0.0,
               log_probs=None, **loss_args):
    """policy_loss of the model on collated rollouts: (loss, metrics, entropy [batch, max_len]).
    The reference policy of the KL term (beta > 0) is the base model: the same weights, adapter off.
    log_probs: completion_logp (None), or a function of its arguments with the same values."""
    if beta > 0 and not hasattr(model, "disable_adapter"):
        raise ValueError(f"beta {beta} > 0: the KL term's reference is the model with its adapter "
                         "off (disable_adapter), only a PEFT model has one; wrap it or pass beta 0")
    log_probs = log_probs or completion_logp
    logp, entropy = log_probs(model, cols, temperature)
    ref_logp = None
    if beta > 0:
        with torch.no_grad(), model.disable_adapter():
            ref_logp, _ = log_probs(model, cols, temperature)
    loss, metrics = policy_loss(logp, cols["behaviour_logp"], cols["advantage"],
                                cols["completion_mask"], ref_logp=ref_logp, beta=beta,
                                reward=cols["reward"], baseline=cols["baseline"], **loss_args)
    return loss, metrics, entropy


def update_step(model, optimizer, rollouts: list[Rollout], *, pad_id: int, policy_version: int,
                temperature: float = 1.0, beta: float = 0.0, max_grad_norm: float = 1.0,
                **loss_args) -> dict:
    """One optimizer step on a batch of rollouts, the plain form: one forward over the batch at the
    sampling temperature, the loss against the stored behaviour log-probs, backward, clip, step;
    a step whose loss or gradient is NaN/inf is skipped (metrics["skipped"] = 1).
    loss_args: policy_loss's (loss_type, is_cap, epsilon, normalization, asymre_tau).
    update_step_engineered (infra/engineered_update.py) takes the same step with the engineering
    (micro-batches, processes, fp16); tests/test_minimal.py keeps the two equal.
    """
    # padded, with ages
    cols = collate(rollouts, pad_id, policy_version, device=next(model.parameters()).device)
    loss, metrics, entropy = batch_loss(model, cols, temperature=temperature, beta=beta,
                                        **loss_args)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # the clip guards against a rare huge step (one batch of unlucky ratios); it is not the method
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    # a NaN/inf step would poison the weights and AdamW's moments for good: skip it
    skipped = not (torch.isfinite(loss) and torch.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    return {"loss": loss.item(), **{k: v.item() for k, v in metrics.items()},
            "grad_norm": grad_norm.item(), "skipped": int(skipped),
            "entropy": masked_mean(entropy, cols["completion_mask"]).item(),
            "age_mean": cols["age"].mean().item(), "age_max": cols["age"].max().item(),
            "uses_mean": sum(rollout.uses for rollout in rollouts) / len(rollouts)}
