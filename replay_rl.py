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
Below them, engineering that changes nothing of the method: update_step_engineered, the step
train.py takes (micro-batches, torchrun, fp16 loss scaling, the batch's figures), and
chunked_completion_logp, completion_logp's values without its [batch, max_len, vocab] logits.
"""
from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from buffer import Rollout, collate

LOSS_TYPES = ("tis", "ppo", "asymre")
NORMALIZATIONS = ("token_mean", "sequence_mean")
# Below this sampling temperature mu is greedy in effect: at T = 0.01 a logit gap of 0.2 already
# gives the sampled token a probability of 1 - 2e-9, so log mu = 0, rho = 1, and the loss and its
# gradient vanish. completion_logp refuses it.
MIN_TEMPERATURE = 0.01
# update_step_engineered's loss_scale for float16 base weights (static)
FP16_LOSS_SCALE = 2.0**10
# Tokens per chunk of chunked_completion_logp (train.py's --logp-chunk): with a 152k vocabulary its
# two fp32 [chunk, vocab] tensors are 0.3 GB, and a chunk is still a large matmul for a GPU.
LOGP_CHUNK = 256
# Architectures whose causal LM computes its logits as lm_head(h) and nothing more (no soft cap, no
# scale): chunked_completion_logp applies the head itself, so it takes only these.
PLAIN_HEAD_MODELS = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3",
                     "olmo2", "smollm3")


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
    # Dropout would make the training forward differ from the sampling one (ratio != 1 on fresh
    # data).
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):    # HF attention layers
            module.attention_dropout = 0.0
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
    train.py runs update_step_engineered: the same step, with the engineering (it is tested equal).
    """
    # padded, with ages
    cols = collate(rollouts, pad_id, policy_version, device=next(model.parameters()).device)
    loss, metrics, _ = batch_loss(model, cols, temperature=temperature, beta=beta, **loss_args)
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
            "age_mean": cols["age"].mean().item(), "age_max": cols["age"].max().item()}


# ---- Engineering: the same step in micro-batches, over processes, in fp16, skipping NaN ----
def update_step_engineered(model, optimizer, rollouts: list[Rollout], *, pad_id: int,
                           policy_version: int, temperature: float = 1.0, beta: float = 0.0,
                           normalization: str = "token_mean", micro_batch_size: int = 0,
                           max_grad_norm: float = 1.0, loss_scale: float = 1.0,
                           logp_chunk: int = 0, **loss_args) -> dict:
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
    - logp_chunk > 0: log pi_theta from chunked_completion_logp, that many tokens at a time: the
      same values, with the logits' memory bounded by the chunk, not by
      micro-batch x length x vocab.
    It is longer than the rest: one loop holds all of the above, and a first reading skips it.
    """
    device = next(model.parameters()).device
    micro = micro_batch_size or len(rollouts)
    ages = [policy_version - rollout.policy_version for rollout in rollouts]
    total_tokens, total_sequences, age_sum, uses_sum = _over_processes(torch.tensor(
        [sum(len(rollout.completion_ids) for rollout in rollouts), len(rollouts), sum(ages),
         sum(rollout.uses for rollout in rollouts)], dtype=torch.float64)).tolist()
    # Metrics add up on the device, read once at the end: each read of a GPU value makes the
    # host wait until the GPU is idle, and the next forward then starts from an idle GPU.
    names = (["loss", "is_ratio_mean", "is_truncated_frac", "approx_kl", "entropy"]
             + (["ref_kl"] if beta > 0 else []))
    sums = torch.zeros(len(names), dtype=torch.float64, device=device)
    ratio_max = torch.zeros((), device=device)
    log_probs = None                                        # batch_loss's default: completion_logp
    if logp_chunk:
        log_probs = lambda m, c, t: chunked_completion_logp(m, c, t, logp_chunk)
    # the divisor of every micro-batch's loss: the whole batch's (policy_loss's num_items_in_batch)
    count = total_tokens if normalization == "token_mean" else total_sequences
    optimizer.zero_grad(set_to_none=True)
    for i in range(0, len(rollouts), micro):
        chunk = rollouts[i:i + micro]
        cols = collate(chunk, pad_id, policy_version, device=device)
        loss, m, entropy = batch_loss(model, cols, temperature=temperature, beta=beta,
                                      normalization=normalization, log_probs=log_probs,
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
    new tensor; t itself in one process. (train.py's other figures go through distributed.py; this
    private copy keeps replay_rl.py whole on its own.)"""
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
