"""Rollouts with Hugging Face ``generate``: G samples per prompt, the behaviour log-probs
log mu(o_t), rewards and group-normalized advantages.

Read in this order:
  - group_advantages: A within each group (the G completions of one prompt).
  - generate_rollouts: samples, rewards and advantages, as Rollouts.
  - generate_with_log_mu: the completions generate_rollouts uses and their log mu, the method's
    way (minimal.py's): the two functions below, one after the other.
  - generate_completions: G samples of each prompt with generate, from softmax(z_t / T) alone.
  - forward_log_mu: log mu by a no-grad forward after generate, as minimal.py takes it. Until the
    next step the model is mu, so it calls completion_logp, the function the loss calls, on
    collate's columns (minimal.py writes that forward out; the values are the same).
  - completion_lengths and end_token_ids: two small helpers of the above.
The method ends there. Below it, after a marker line, the guards: they refuse whatever would make
generate sample from another distribution than softmax(z_t / T).
The engineering of generation is in infra/generation.py: generate_recorded, which train.py takes
with --record-log-mu (log mu recorded while generate samples, so that no forward follows; the
same completions and log mu, tested), the shared prefill, and the greedy evals.
The module needs a causal LM, its tokenizer and a reward function
``reward_fn(prompt, completion) -> float``. Of this project it needs buffer.py (Rollout, collate)
and replay_rl.py (completion_logp, refuse_active_dropout).
"""
from __future__ import annotations

import warnings

import torch
from transformers import GenerationConfig

from buffer import Rollout, collate
from replay_rl import completion_logp, refuse_active_dropout


# ---- the method: advantages, rollouts, log mu --------------------------------------------------
def group_advantages(rewards: torch.Tensor, group: torch.Tensor,
                     std_floor: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean r) / (std r + std_floor), the mean and std over the rewards of i's group:
    the completions of the same prompt.   rewards: [n] one reward per completion; group: [n] which
    prompt each completion answers (any ids, in any order: the groups come from the ids, not from
    the layout of the list).

    std is the sample standard deviation (as TRL's GRPO); std_floor keeps a near-equal group from
    dividing by ~0 (it is not PPO's clip range epsilon). A group whose rewards are all equal (a
    group of one too) gets exactly A = 0 (not rounding noise / std_floor): it costs generation and
    teaches nothing (counted as zero_adv_frac).
    """
    group = torch.as_tensor(group)
    if rewards.dim() != 1 or group.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group {tuple(group.shape)}: give "
                         "one reward and one group id per completion, both flat [n]")
    if group.is_floating_point():
        raise ValueError("group ids must be integers (arange(n) // G, not / G: float ids made "
                         "each completion a group of one)")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite (a NaN or inf makes its whole group's A NaN)")
    advantages = torch.zeros_like(rewards)
    for g in group.unique():
        members = group == g
        r = rewards[members]
        if (r != r[0]).any():               # equal rewards keep A = 0 exactly
            advantages[members] = (r - r.mean()) / (r.std() + std_floor)
    return advantages


def generate_rollouts(model, tokenizer, prompts: list[str], reward_fn, *, num_generations: int,
                      max_new_tokens: int, temperature: float = 1.0, policy_version: int,
                      sampler=None) -> tuple[list[Rollout], dict]:
    """Generate G = ``num_generations`` completions per prompt from mu (the model as it is now).
    Returns (rollouts, figures): the Rollouts, in the sampler's row order (prompt-major by
    default), and the round's figures. Each Rollout
    carries log mu(o_t) of each token, its reward r and its advantage A within its group of G.
    prompts: text as the model reads it, special tokens included (``check_bos``). reward_fn
    (prompt, completion) gets the same text. policy_version: the model's optimizer steps now
    (no default). With G = 1, A = 0 for all rollouts and tis and ppo learn nothing (a round in which
    every group's rewards are equal warns; Python shows that warning once).
    sampler: the function that generates the completions and their log mu; None: the method's,
    generate_with_log_mu (python train.py's). Another with its signature and return gives the same
    values faster: infra/generation.py's recording_sampler(), with --record-log-mu."""
    G = num_generations
    prompt_ids, completions, group, eos_ids, log_mu, mu_entropy = (sampler or generate_with_log_mu)(
        model, tokenizer, prompts, G, max_new_tokens=max_new_tokens, temperature=temperature)
    lengths, ended = completion_lengths(completions, eos_ids)
    if not (len(group) == len(completions)
            and torch.bincount(group, minlength=len(prompts)).tolist() == [G] * len(prompts)):
        raise ValueError(f"group must name each row's prompt, G = {G} rows for each of the "
                         f"{len(prompts)} prompts: got {group.tolist()}")
    answers = group.tolist()                                # row i answers prompt answers[i]
    kept = lengths.tolist()                                         # tokens kept of each completion
    mask = torch.arange(completions.shape[1])[None, :] < lengths[:, None]
    # decode() on plain lists: on tensor slices it spends longer converting them than decoding.
    texts = [tokenizer.decode(row[:k], skip_special_tokens=True)
             for row, k in zip(completions.tolist(), kept)]
    rewards = torch.tensor([float(reward_fn(prompts[p], text)) for p, text in zip(answers, texts)])
    if not torch.isfinite(rewards).all():   # a NaN A would skip every step that draws its group
        bad = rewards[~torch.isfinite(rewards)][0].item()
        raise ValueError(f"reward_fn returned {bad} for a completion: rewards must be finite")
    advantages = group_advantages(rewards, group)
    if not advantages.any():
        warnings.warn(f"every group of this round had equal rewards (G = {G}): A = 0 for all, "
                      "so tis and ppo get no gradient from it"
                      + (" (with G = 1, never)" if G == 1 else ""), stacklevel=2)
    # Unpadded per-rollout tensors: one masked copy, then split into views (no per-row ops). They
    # are made here, outside generate_completions' inference_mode (prompt_ids cloned), so they are
    # ordinary tensors: a caller may modify them or use them in autograd.
    completion_ids, behaviour_logp = completions[mask].split(kept), log_mu[mask].split(kept)
    baselines = (torch.zeros(len(prompts)).index_add_(0, group, rewards) / G).tolist()  # V
    rollouts = [Rollout(prompt_ids=prompt_ids[p].clone(), completion_ids=completion_ids[i],
                        behaviour_logp=behaviour_logp[i], reward=reward, advantage=advantage,
                        policy_version=policy_version, baseline=baselines[p],
                        temperature=temperature)
                for i, (p, reward, advantage) in enumerate(zip(answers, rewards.tolist(),
                                                                advantages.tolist()))]
    taught = torch.zeros(len(prompts)).index_add_(0, group, (advantages != 0).float()) > 0
    figures = {"completions": texts, "reward": rewards.mean().item(),
             "new_tokens": int(lengths.sum()),
             "zero_adv_frac": 1 - taught.float().mean().item(),     # groups with A = 0 for all
             "rollout_entropy": torch.where(mask, mu_entropy, 0.0).sum().item()        # mu's
                                / mask.sum().item(),
             # metrics.jsonl's keys: the mean length, and the part cut at max_new_tokens (not at C)
             "completion_len": lengths.float().mean().item(),
             "truncated_frac": (~ended).float().mean().item()}
    return rollouts, figures


def generate_with_log_mu(model, tokenizer, prompts: list[str], G: int, *, max_new_tokens: int,
                         temperature: float):
    """G completions of each prompt with generate, then log mu by one no-grad forward over every
    sampled sequence (forward_log_mu: the model has taken no step since it sampled, so its
    log pi_theta is log mu). minimal.py takes log mu the same way. Returns (prompt_ids,
    completions, group, eos_ids, log_mu, mu_entropy): generate_completions' first four, and log mu
    and mu's entropy [P * G, max_len]. A sampler passed to generate_rollouts returns the same; its
    rows may come in any order, group naming each row's prompt (G rows for each).
    The model's own generation_config cannot change the sampling. Its top_k, top_p, repetition
    penalty and the like are overridden with neutral values. A setting that acts whenever it is
    set (suppressed tokens, ...) is refused. So is active dropout in training mode."""
    prompt_ids, completions, group, eos_ids, pad_id = generate_completions(
        model, tokenizer, prompts, G, max_new_tokens=max_new_tokens, temperature=temperature)
    lengths, _ = completion_lengths(completions, eos_ids)
    log_mu, mu_entropy = forward_log_mu(model, [prompt_ids[p] for p in group.tolist()],
                                        completions, lengths, pad_id=pad_id, eos_ids=eos_ids,
                                        temperature=temperature)
    return prompt_ids, completions, group, eos_ids, log_mu, mu_entropy


@torch.inference_mode()
def generate_completions(model, tokenizer, prompts: list[str], G: int, *,
                         max_new_tokens: int, temperature: float):
    """G samples of each prompt, drawn from softmax(z_t / T) alone, with generate. Returns the
    prompts' ids (unpadded, one tensor each), the completions [P * G, max_len] on the CPU (generate
    pads each after its end), group [P * G], the prompt each row answers (prompt p's G samples are
    rows p*G to p*G + G - 1: group = row // G), the end token ids and the pad id generate padded
    with. Prompts are left-padded, so every completion starts at the same column.
    Every setting of generate that would change the distribution is passed at its plain value
    (PLAIN_SAMPLING), so the model's own generation_config cannot fill it in. A setting that
    cannot be overridden is refused, and so is active dropout in training mode.
    """
    check_bos(tokenizer, prompts)
    enc, prompt_ids = left_padded(tokenizer, prompts)
    eos_ids, pad_id = end_token_ids(model, tokenizer)
    gen_config = GenerationConfig(**PLAIN_SAMPLING, temperature=temperature,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
                                  pad_token_id=pad_id)
    refuse_active_dropout(model)                    # refused before any model work
    refuse_sampling_changes(model, gen_config)
    device = next(model.parameters()).device
    sequences = model.generate(input_ids=enc.input_ids.repeat_interleave(G, 0).to(device),
                               attention_mask=enc.attention_mask.repeat_interleave(G, 0).to(device),
                               generation_config=gen_config)            # [P * G, prompt + new]
    group = torch.arange(len(sequences)) // G                          # row i answers i // G
    return prompt_ids, sequences[:, enc.input_ids.shape[1]:].cpu(), group, eos_ids, pad_id


def left_padded(tokenizer, prompts: list[str]):
    """(the tokenizer's left-padded batch, each prompt's own ids unpadded). The prompts carry their
    own special tokens (check_bos), so the tokenizer adds none."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=False)
    return enc, enc.input_ids[enc.attention_mask.bool()].split(enc.attention_mask.sum(1).tolist())


@torch.no_grad()
def forward_log_mu(model, prompt_ids: list[torch.Tensor], completions: torch.Tensor,
                   lengths: torch.Tensor, *, pad_id: int, eos_ids: list[int], temperature: float,
                   at_a_time: int | None = None):
    """log mu(o_t) and mu's entropy, [batch, max_len] each (0 past a completion's end), by a
    forward after generate. Until the next optimizer step the model is mu, so log mu is the
    log pi_theta the loss takes: completion_logp on collate's columns, here with no gradient.
    Call it right after generate, before any step: called again at replay it gives log pi_theta,
    rho = 1, and the staleness correction is silently gone.
    prompt_ids: one unpadded prompt per completion; completions: [batch, max_len] as generate
    returned them; lengths: the tokens each keeps (completion_lengths). at_a_time: completions
    scored at a time, so that the logits held are [at_a_time, max_len, vocab], not [batch, ...];
    None: as many as keep them within 2^26 values (256 MB in float32; the demo: all at once)."""
    if at_a_time is None:
        vocab = model.get_output_embeddings().weight.shape[0]
        at_a_time = max(1, 2**26 // (completions.shape[1] * vocab))
    # stand-in Rollouts, only to reuse collate: it reads their ids and T; the rest are dummies
    stand_ins = [Rollout(prompt_ids=prompt, completion_ids=row[:k].cpu(),
                         behaviour_logp=torch.zeros(k), reward=0.0, advantage=0.0,
                         policy_version=0, baseline=0.0, temperature=temperature)
                 for prompt, row, k in zip(prompt_ids, completions, lengths.tolist())]
    device = next(model.parameters()).device
    log_mu, entropy = torch.zeros(completions.shape), torch.zeros(completions.shape)
    for start in range(0, len(stand_ins), at_a_time):
        cols = collate(stand_ins[start:start + at_a_time], pad_id, device=device, eos_ids=eos_ids)
        part, part_entropy = completion_logp(model, cols, temperature)   # mu's, no step yet
        end, width = start + part.shape[0], part.shape[1]
        log_mu[start:end, :width] = part.float().cpu()
        entropy[start:end, :width] = part_entropy.float().cpu()
    return log_mu, entropy


def completion_lengths(completions: torch.Tensor,
                       eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths, ended) of completions [P * G, max_len]: each keeps its tokens up to and
    including its first end token (the tokenizer's EOS or any of the model's eos_token_id list;
    pad == eos is common, so all after it is padding), else all (cut at max_new_tokens: ended
    False)."""
    eos_cells = torch.isin(completions, torch.tensor(eos_ids))      # bool [P * G, max_len]
    max_len = completions.shape[1]
    ended = eos_cells.any(1)
    first_eos = torch.where(ended, eos_cells.int().argmax(1),
                            torch.full_like(ended, max_len, dtype=torch.long))
    return torch.clamp(first_eos + 1, max=max_len), ended


def end_token_ids(model, tokenizer) -> tuple[list[int], int]:
    """(ids that end a completion, pad id): the tokenizer's EOS plus the model's eos_token_id list
    (chat models often end a turn with a token that is not the tokenizer's EOS)."""
    model_eos = getattr(model.generation_config, "eos_token_id", None)
    model_eos = [model_eos] if isinstance(model_eos, int) else list(model_eos or [])
    eos_ids = sorted({tokenizer.eos_token_id, *model_eos} - {None})
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return eos_ids, pad_id


# ---- the guards: sampling from softmax(z_t / T) alone, as recorded ------------------------------
# generate's settings that change the distribution a token is drawn from, at the values that leave
# it softmax(z_t / T), the one the stored log mu is taken from. Both samplers pass them
# all: generate fills each field its caller leaves unset from the model's own generation_config
# (Qwen-Instruct ships repetition_penalty, top_k, top_p), then from its defaults (top_k 50).
# min_length is not among them: given min_new_tokens, generate replaces it (prompt length +
# min_new_tokens) and warns at every call if both are passed; sampling_changes still checks it.
PLAIN_SAMPLING = dict(do_sample=True, num_beams=1, top_k=0, top_p=1.0, typical_p=1.0,
                      epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0,
                      encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
                      encoder_no_repeat_ngram_size=0, min_new_tokens=0, guidance_scale=1.0)
# settings that act whenever they are set (None: off), so a model's own is refused, not overridden
SET_TO_ACT = ("min_p", "top_h", "bad_words_ids", "sequence_bias", "suppress_tokens",
              "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
              "exponential_decay_length_penalty", "watermarking_config", "prompt_lookup_num_tokens")


def sampling_changes(model, generation_config: GenerationConfig) -> dict:
    """{setting: value} of what would make ``generate(generation_config=...)`` sample from another
    distribution than softmax(z_t / T): as generate reads them, from generation_config, else the
    model's generation_config, else generate's defaults (do_sample False, top_k 50)."""
    def used(name):
        value = getattr(generation_config, name, None)
        return getattr(model.generation_config, name, None) if value is None else value
    found = {name: used(name) for name in (*PLAIN_SAMPLING, *SET_TO_ACT)}
    found["do_sample"] = found["do_sample"] or False
    found["top_k"] = 50 if found["top_k"] is None else found["top_k"]
    if found["min_new_tokens"] is None:     # else min_new_tokens replaces min_length
        found["min_length"] = used("min_length") or None
    return {name: value for name, value in found.items()
            if value is not None and value != PLAIN_SAMPLING.get(name)}


def refuse_sampling_changes(model, generation_config: GenerationConfig) -> None:
    """Refuses, in one line, a generation_config (or the model's own, which generate reads for
    what it leaves unset) that would sample from another distribution than softmax(z_t / T)."""
    changes = sampling_changes(model, generation_config)
    if changes:
        why = (f"top_p {changes['top_p']} < 1: the stored log mu would ignore the nucleus"
               if "top_p" in changes else "generate would not sample from softmax(z_t / T), "
               "the distribution recorded as log mu")
        raise ValueError(f"{why}: {changes} (in the generation config or the model's): pass "
                         "rollout.PLAIN_SAMPLING's values, unset the others")


def check_bos(tokenizer, prompts: list[str]) -> None:
    """Warns (once per place it is called from) when the tokenizer adds a BOS token to text and a
    prompt does not begin with it: prompts are tokenized as written (add_special_tokens=False)."""
    bos = tokenizer.bos_token
    if bos is None or tokenizer("").input_ids[:1] != [tokenizer.bos_token_id]:
        return
    if any(not prompt.startswith(bos) for prompt in prompts):
        warnings.warn(f"a prompt does not begin with {bos!r}, which this tokenizer adds to text: "
                      "prompts are tokenized as written, so the model reads it without; begin "
                      "each with tokenizer.bos_token or use the chat template", stacklevel=3)


