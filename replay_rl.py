"""The policy (a causal LM with LoRA), the off-policy policy-gradient loss and the update step.

    loss_type "tis" (default), truncated importance sampling, token level:
        rho_t = pi_theta(o_t) / mu(o_t)          mu = the policy that generated the rollout
        w_t   = min(rho_t, C)                    C = is_cap, no gradient through w_t
        L     = - sum_t w_t * A * log pi_theta(o_t)       (normalized, see below)
    loss_type "ppo", the clipped GRPO/PPO objective with mu as the "old" policy, no KL term:
        L     = - sum_t min(rho_t * A, clip(rho_t, 1 - eps, 1 + eps) * A)
    loss_type "asymre", asymmetric REINFORCE, no importance ratio at all:
        L     = - sum_t (r - (V - tau)) * log pi_theta(o_t)      V = mean reward of the group
        (policy_loss takes r and V as ``reward`` and ``baseline`` and forms the coefficient itself:
        not the group-normalized A; tau > 0 favours what went right over what went wrong)
    normalization "token_mean": divide by the number of completion tokens in the batch;
                  "sequence_mean": average over tokens within a sequence, then over sequences.
With rho = 1 (fresh, on-policy data) tis and ppo both reduce to the plain policy gradient
-A * grad log pi.   (o_t: the t-th completion token; the symbols are the README's table.)
"""
from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from buffer import Rollout, collate

LOSS_TYPES = ("tis", "ppo", "asymre")
NORMALIZATIONS = ("token_mean", "sequence_mean")
FP16_LOSS_SCALE = 2.0**10       # update_step's loss_scale for float16 base weights (static)


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The model's tokenizer, padding on the left (prompts for generate), with EOS as the pad token
    if it has none."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    # Engineering: AutoTokenizer picks the class from the model type (qwen2 -> Qwen2Tokenizer), which rebuilds the
    # pre-tokenizer: for a folder whose tokenizer.json is not Qwen's own (e.g. a character vocabulary)
    # that silently drops spaces. Then the tokenizer.json exactly as saved is the right one.
    probe = "12 + 3 = 15"
    if tokenizer.decode(tokenizer.encode(probe, add_special_tokens=False)) != probe:
        from transformers import PreTrainedTokenizerFast
        try:
            saved = PreTrainedTokenizerFast.from_pretrained(name_or_path)
        except (OSError, ValueError):        # no tokenizer.json (e.g. sentencepiece only): keep AutoTokenizer's
            saved = None
        if saved is not None and saved.decode(saved.encode(probe, add_special_tokens=False)) == probe:
            tokenizer = saved
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(name_or_path: str, *, lora_r: int = 16, lora_alpha: int | None = None,
                target_modules="all-linear", load_in_4bit: bool = False,
                device: str = "cpu", dtype: torch.dtype = torch.float32, gradient_checkpointing: bool = False,
                trust_remote_code: bool = False, tokenizer=None):
    """Load a Hugging Face causal LM (hub id or local folder) and wrap it with a fresh LoRA adapter.

    Returns (peft_model, tokenizer): pi_theta, with only the LoRA weights trainable. For exact
    importance ratios the model samples with only the settings rollout.py passes (the checkpoint's
    own generation defaults are dropped) and without dropout, so on fresh data rho = 1.
    tokenizer: one from ``load_tokenizer`` (else loaded here). load_in_4bit: nf4 weights with
    double quantization, computing in ``dtype``.
    gradient_checkpointing: recompute activations in backward (less memory, ~30% more time).
    """
    from peft import LoraConfig, get_peft_model

    tokenizer = tokenizer or load_tokenizer(name_or_path, trust_remote_code)
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
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
        # Engineering: bitsandbytes on CPU repacks 4-bit weights after a no-grad forward (generate), after
        # which backward silently gives no LoRA gradients; this flag keeps the plain layout.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    else:
        model.to(device)
        if gradient_checkpointing:
            # Engineering: transformers renamed the method (and its keyword); the old name is deprecated
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()      # so checkpointed blocks see a tensor that needs grad
    # Sampling must follow only the settings rollout.py passes: a checkpoint's shipped defaults
    # (Qwen-Instruct: repetition_penalty, top_k, temperature) would otherwise fill in the unset
    # fields of generate() and change the distribution behind the stored behaviour log-probs.
    # Only the end tokens are kept.
    model.generation_config = GenerationConfig(eos_token_id=model.generation_config.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    # Dropout would make the training forward differ from the sampling one (ratio != 1 on fresh data).
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):    # HF attention layers
            module.attention_dropout = 0.0
    lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r if lora_alpha is None else lora_alpha, lora_dropout=0.0,
                      target_modules=target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, lora), tokenizer


def completion_logp(model, batch: dict[str, torch.Tensor], temperature: float = 1.0):
    """log pi_theta(o_t | o_<t) of every completion column, and the policy entropy there.

    batch from ``collate``: input_ids [batch, prompt_len + completion_len], completion_mask
    [batch, completion_len]. The logits at column j predict token j + 1, so the completion tokens
    (columns prompt_len .. prompt_len + completion_len - 1) are scored by the logits one column
    to their left; only those completion_len columns are materialized. The logits are divided by
    the sampling temperature T, as they were when mu sampled.
    Returns logp [batch, completion_len] (with gradient) and entropy [batch, completion_len] (no gradient).
    """
    completion_len = batch["completion_mask"].shape[1]
    # The last column is not fed: its logits would predict a token after the sequence, and under
    # the causal mask no other column depends on it.
    out = model(input_ids=batch["input_ids"][:, :-1], attention_mask=batch["attention_mask"][:, :-1],
                position_ids=batch["position_ids"][:, :-1], logits_to_keep=completion_len)
    # Engineering: each full-vocabulary pass over [batch, completion_len, vocab] costs as much as a
    # small matmul (on a GPU, with a 152k vocabulary, each was ~2% of a training step): no division
    # when T = 1, and the entropy's sum_v p_v z_v as a batched dot product (einsum), without a
    # [batch, completion_len, vocab] product in between.
    logits = out.logits.float()                                      # [batch, completion_len, vocab]
    if temperature != 1.0:
        logits = logits / temperature
    tokens = batch["input_ids"][:, -completion_len:]
    log_z = torch.logsumexp(logits, dim=-1)                          # [batch, completion_len]
    logp = logits.gather(-1, tokens[..., None]).squeeze(-1) - log_z
    with torch.no_grad():       # H = log Z - sum_v p_v z_v
        entropy = log_z - torch.einsum("bcv,bcv->bc", torch.softmax(logits, -1), logits)
    return logp, entropy


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantage: torch.Tensor | None,
                mask: torch.Tensor, *, loss_type: str = "tis", is_cap: float = 2.0,
                epsilon: float = 0.2, normalization: str = "token_mean",
                ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                reward: torch.Tensor | None = None, baseline: torch.Tensor | None = None,
                asymre_tau: float = 0.1):
    """The off-policy policy-gradient loss (see the module docstring for the formulas).

    logp, behaviour_logp, mask: [batch, completion_len];  advantage: [batch], one A per rollout
    (tis and ppo; anything else, e.g. a per-token [batch, completion_len], raises: it would
    broadcast to [batch, batch, completion_len] and give a wrong loss silently).
    asymre uses no advantage: it needs reward r [batch] and baseline V [batch] (the group's mean
    reward) and weighs log pi by r - (V - asymre_tau); without them it raises. Returns (loss, metrics).
    With beta > 0 and ref_logp [batch, completion_len] (the reference model's log-probs), adds
    beta * KL, with the per-token estimate  kl_t = exp(d_t) - d_t - 1,
    d_t = log pi_ref(o_t) - log pi_theta(o_t)  (>= 0), normalized like the policy term.
    metrics (0-dim tensors): is_ratio_mean / is_ratio_max over real tokens; is_truncated_frac = fraction of
    tokens whose weight was cut to the cap (tis) or whose clipped term was active (ppo);
    approx_kl = mean((rho - 1) - log rho), an unbiased estimate of KL(mu || pi_theta).
    """
    log_ratio = logp - behaviour_logp
    ratio = torch.exp(log_ratio)                                     # rho_t
    if loss_type == "asymre":
        if reward is None or baseline is None:
            raise ValueError("loss_type 'asymre' weighs log pi by r - (V - tau), not by the "
                             "group-normalized advantage: pass reward and baseline (V, the mean "
                             "reward of each rollout's group)")
        A = reward - (baseline - asymre_tau)
    else:
        A = advantage
    # One coefficient per rollout. A per-token [batch, completion_len] would broadcast against
    # logp to [batch, batch, completion_len] below and give a wrong loss without an error.
    if A is None or A.shape != logp.shape[:1]:
        raise ValueError(f"the advantage (asymre: reward and baseline) must have shape [batch] = "
                         f"{list(logp.shape[:1])}, one value per rollout; got "
                         f"{None if A is None else list(A.shape)}")
    A = A[:, None]                                                   # [batch, 1]
    if loss_type == "tis":
        weight = ratio.detach().clamp(max=is_cap)
        per_token = -weight * A * logp
        cut = ratio.detach() > is_cap
    elif loss_type == "asymre":
        per_token = -A * logp
        cut = torch.zeros_like(mask, dtype=torch.bool)
    elif loss_type == "ppo":
        unclipped = ratio * A
        clipped = ratio.clamp(1 - epsilon, 1 + epsilon) * A
        per_token = -torch.minimum(unclipped, clipped)
        cut = (clipped < unclipped).detach()
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}, expected one of {LOSS_TYPES}")

    if normalization not in NORMALIZATIONS:
        raise ValueError(f"unknown normalization {normalization!r}, expected one of {NORMALIZATIONS}")

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if normalization == "token_mean":
            return (x * mask).sum() / mask.sum().clamp(min=1)
        return ((x * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()

    loss = reduce(per_token)
    kl = None
    if beta > 0:
        d = ref_logp - logp
        kl = reduce(torch.exp(d) - d - 1)
        loss = loss + beta * kl

    with torch.no_grad():       # 0-dim tensors: reading them (float()) waits for a GPU, so the caller decides when
        n = mask.sum().clamp(min=1)
        r = ratio.detach()
        metrics = {
            "is_ratio_mean": (r * mask).sum() / n,
            "is_ratio_max": r.masked_fill(mask == 0, 0).max(),
            "is_truncated_frac": (cut.float() * mask).sum() / n,
            "approx_kl": ((r - 1 - log_ratio.detach()) * mask).sum() / n,
        }
        if kl is not None:
            metrics["ref_kl"] = kl.detach()
    return loss, metrics


def update_step(model, optimizer, rollouts: list[Rollout], *, pad_id: int, policy_version: int,
                loss_type: str = "tis", is_cap: float = 2.0, epsilon: float = 0.2,
                normalization: str = "token_mean", temperature: float = 1.0, beta: float = 0.0,
                asymre_tau: float = 0.1, micro_batch_size: int = 0, max_grad_norm: float = 1.0,
                loss_scale: float = 1.0) -> dict:
    """One optimizer step on a batch of rollouts, in micro-batches if asked (same gradient).

    The loss is policy_loss on log pi_theta (completion_logp at the sampling temperature) against
    the stored behaviour log-probs; a rollout's age is policy_version (steps so far) minus its own.
    Each micro-batch loss is scaled by its share of the batch (tokens for token_mean, sequences
    for sequence_mean), so the accumulated gradient equals that of the whole batch at once.
    A step whose loss or gradient is not finite is skipped (metrics["skipped"] = 1): the weights
    and the optimizer state stay as they were.
    Engineering: under torchrun each process passes its share of the batch; the step and the
    metrics are those of the whole batch, the same on every process, at three collectives a step:
    the batch's counts, the gradients with the metric sums, the maxima.
    loss_scale S, for float16 base weights (FP16_LOSS_SCALE): backward runs on S * L and the
    gradients are divided by S before clipping, g = grad(S * L) / S = grad(L), the same step; in
    between, the gradients of the fp16 activations are S times larger, so the small ones do not
    underflow to 0 (fp16's smallest normal is 6e-5). One that overflows is inf: the step is skipped.
    """
    device = next(model.parameters()).device
    micro = micro_batch_size or len(rollouts)
    chunks = [rollouts[i:i + micro] for i in range(0, len(rollouts), micro)]
    # Several processes (torchrun): each holds part of the batch. The normalizers are the whole
    # batch's token and sequence counts (one sum with the ages and use counts); the gradients are
    # summed over the processes below, with the metrics.
    ages = [policy_version - r.policy_version for r in rollouts]
    counts = _over_processes(torch.tensor([sum(len(r.completion_ids) for r in rollouts), len(rollouts),
                                           sum(ages), sum(r.uses for r in rollouts)], dtype=torch.float64))
    total_tokens, total_sequences, age_sum, uses_sum = counts.tolist()
    # Metrics add up on the device, read once at the end: each read of a GPU value makes the
    # host wait until the GPU is idle, and the next forward then starts from an idle GPU.
    names = ["loss", "is_ratio_mean", "is_truncated_frac", "approx_kl", "entropy"] + (["ref_kl"] if beta > 0 else [])
    sums = torch.zeros(len(names), dtype=torch.float64, device=device)
    ratio_max = torch.zeros((), device=device)
    optimizer.zero_grad(set_to_none=True)
    for chunk in chunks:
        batch = {k: v.to(device) for k, v in collate(chunk, pad_id, policy_version).items()}
        logp, entropy = completion_logp(model, batch, temperature)
        ref_logp = None
        if beta > 0:        # the reference model is the base model: the same weights, adapter off
            with torch.no_grad(), model.disable_adapter():
                ref_logp, _ = completion_logp(model, batch, temperature)
        loss, m = policy_loss(logp, batch["behaviour_logp"], batch["advantage"], batch["completion_mask"],
                              loss_type=loss_type, is_cap=is_cap, epsilon=epsilon, normalization=normalization,
                              ref_logp=ref_logp, beta=beta, reward=batch["reward"], baseline=batch["baseline"],
                              asymre_tau=asymre_tau)
        token_share = sum(len(r.completion_ids) for r in chunk) / total_tokens        # counted on the host
        share = token_share if normalization == "token_mean" else len(chunk) / total_sequences
        (loss * share * loss_scale).backward()
        with torch.no_grad():   # token means in every normalization; loss and ref_kl normalized like the loss
            sums += torch.stack([loss * share, m["is_ratio_mean"] * token_share, m["is_truncated_frac"] * token_share,
                                 m["approx_kl"] * token_share,
                                 (entropy * batch["completion_mask"]).sum() / total_tokens]
                                + ([m["ref_kl"] * share] if beta > 0 else [])).double()
            ratio_max = torch.maximum(ratio_max, m["is_ratio_max"])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if loss_scale != 1.0:       # unscaled: the gradient of the loss itself (LoRA weights are fp32)
        for p in (p for p in params if p.grad is not None):
            p.grad.div_(loss_scale)
    if torch.distributed.is_initialized():      # data parallel: the whole batch's gradient, on every process
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _over_processes(torch.cat([g.flatten().float() for g in grads] + [sums.float()]))
        for p, g in zip(params, flat[:-len(names)].split([g.numel() for g in grads])):
            p.grad = g.view_as(p).to(p.dtype, copy=True)
        # the metric sums travelled with the gradient, in its float32 (the gradient is exact as before)
        sums = flat[-len(names):].double()
    maxima = _over_processes(torch.stack([ratio_max.double(), torch.tensor(float(max(ages)), device=device,
                                                                           dtype=torch.float64)]), "max")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    *values, ratio_max, age_max, grad_norm = torch.cat([sums, maxima, grad_norm.to(sums)[None]]).tolist()
    metrics = dict(zip(names, values))
    # A NaN/inf loss or gradient would poison the weights and Adam's moments for good: skip the step.
    skipped = not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm))
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return {**metrics, "skipped": int(skipped), "is_ratio_max": ratio_max, "grad_norm": grad_norm,
            "age_mean": age_sum / total_sequences, "age_max": age_max, "uses_mean": uses_sum / total_sequences}


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
