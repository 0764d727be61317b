"""Rollouts with Hugging Face ``generate``: G samples per prompt, the behaviour log-probs
log mu(o_t), rewards and group-normalized advantages.

Read in this order:
  - group_advantages: A within each group (the G completions of one prompt).
  - generate_rollouts: samples, rewards and advantages, as Rollouts.
  - generate_completions: G samples of each prompt with generate, from softmax(z_t / T) alone.
  - forward_log_mu: log mu by a no-grad forward after generate, as minimal.py takes it. Until the
    next step the model is mu, so it calls completion_logp, the function the loss calls, on
    collate's columns (minimal.py writes that forward out; the values are the same).
  - completion_lengths and end_token_ids: two small helpers of the above.
The method ends there. Below it, each after a marker line:
  - engineering, which train.py takes with --record-log-mu: generate_recorded samples as
    generate_completions does and records log mu while generate samples (the recorder
    BehaviourLogProbs), so it saves that forward (one over every sampled sequence).
    generate_rollouts takes it as its sampler (recording_sampler). The recorder relies on the
    order in which transformers 5.x runs its logits processors, which its guard checks
    (check_caller). Both ways give the same samples and log mu (tested).
  - the guards: they refuse whatever would make generate sample from another distribution than
    softmax(z_t / T).
  - engineering that gives the same samples faster (each prompt prefilled once), and the greedy
    evals.
The module needs a causal LM, its tokenizer and a reward function
``reward_fn(prompt, completion) -> float``. Of this project it needs buffer.py (Rollout, collate)
and replay_rl.py (completion_logp, refuse_active_dropout).
"""
from __future__ import annotations

import copy
import functools
import inspect
import sys
import warnings

import torch
from transformers import GenerationConfig
# the recorder's and the shared prefill's (engineering, below the marker)
from transformers import (DynamicCache, LogitsProcessor, LogitsProcessorList,
                          MinLengthLogitsProcessor, TemperatureLogitsWarper)

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
    Returns (rollouts, figures): the Rollouts, prompt-major, and the round's figures. Each Rollout
    carries log mu(o_t) of each token, its reward r and its advantage A within its group of G.
    prompts: text as the model reads it, special tokens included (``check_bos``). reward_fn
    (prompt, completion) gets the same text. policy_version: the model's optimizer steps now
    (no default). With G = 1, A = 0 for all rollouts and tis and ppo learn nothing (a round in which
    every group's rewards are equal warns; Python shows that warning once).
    log mu is taken as minimal.py takes it: generate_completions samples, then forward_log_mu runs
    one no-grad forward over every sampled sequence (completion_logp: the model has taken no step
    since it sampled, so its log pi_theta is log mu). python train.py samples this way.
    The model's own generation_config cannot change the sampling. Its top_k, top_p, repetition
    penalty and the like are overridden with neutral values. A setting that acts whenever it is
    set (suppressed tokens, ...) is refused. So is active dropout in training mode.
    sampler (engineering; None: the method above): a function that gives the same completions with
    log mu recorded while generate samples, with no forward after: (model, tokenizer, prompts, G,
    *, max_new_tokens, temperature) -> (prompt_ids, completions, eos_ids, log_mu, mu_entropy).
    recording_sampler(...) makes it (generate_recorded, below the marker); train.py passes one
    with --record-log-mu."""
    G = num_generations
    if sampler is None:         # the method, minimal.py's way: generate, then one no-grad forward
        prompt_ids, completions, eos_ids = generate_completions(
            model, tokenizer, prompts, G, max_new_tokens=max_new_tokens, temperature=temperature)
        lengths, ended = completion_lengths(completions, eos_ids)
        _, pad_id = end_token_ids(model, tokenizer)         # the pad id generate padded with
        log_mu, mu_entropy = forward_log_mu(
            model, [prompt_ids[i // G] for i in range(len(completions))], completions, lengths,
            pad_id=pad_id, eos_ids=eos_ids, temperature=temperature)
    else:                       # engineering: the same samples, log mu recorded while sampling
        prompt_ids, completions, eos_ids, log_mu, mu_entropy = sampler(
            model, tokenizer, prompts, G, max_new_tokens=max_new_tokens, temperature=temperature)
        lengths, ended = completion_lengths(completions, eos_ids)
    kept = lengths.tolist()                                         # tokens kept of each completion
    mask = torch.arange(completions.shape[1])[None, :] < lengths[:, None]
    # decode() on plain lists: on tensor slices it spends longer converting them than decoding.
    texts = [tokenizer.decode(row[:k], skip_special_tokens=True)
             for row, k in zip(completions.tolist(), kept)]
    rewards = torch.tensor([float(reward_fn(prompts[i // G], texts[i])) for i in range(len(texts))])
    if not torch.isfinite(rewards).all():   # a NaN A would skip every step that draws its group
        bad = rewards[~torch.isfinite(rewards)][0].item()
        raise ValueError(f"reward_fn returned {bad} for a completion: rewards must be finite")
    advantages = group_advantages(rewards, torch.arange(len(texts)) // G)   # i answers i // G
    if not advantages.any():
        warnings.warn(f"every group of this round had equal rewards (G = {G}): A = 0 for all, "
                      "so tis and ppo get no gradient from it"
                      + (" (with G = 1, never)" if G == 1 else ""), stacklevel=2)
    # Unpadded per-rollout tensors: one masked copy, then split into views (no per-row ops). They
    # are made here, outside generate_completions' inference_mode (prompt_ids cloned), so they are
    # ordinary tensors: a caller may modify them or use them in autograd.
    completion_ids, behaviour_logp = completions[mask].split(kept), log_mu[mask].split(kept)
    baselines = rewards.view(-1, G).mean(1).tolist()   # prompt-major, as generate made them
    rollouts = [Rollout(prompt_ids=prompt_ids[i // G].clone(), completion_ids=completion_ids[i],
                        behaviour_logp=behaviour_logp[i], reward=reward, advantage=advantage,
                        policy_version=policy_version, baseline=baselines[i // G],
                        temperature=temperature)
                for i, (reward, advantage) in enumerate(zip(rewards.tolist(), advantages.tolist()))]
    figures = {"completions": texts, "reward": rewards.mean().item(),
             "new_tokens": int(lengths.sum()),
             "zero_adv_frac": (advantages.view(-1, G) == 0).all(1).float().mean().item(),
             "rollout_entropy": torch.where(mask, mu_entropy, 0.0).sum().item()        # mu's
                                / mask.sum().item(),
             # metrics.jsonl's keys: the mean length, and the part cut at max_new_tokens (not at C)
             "completion_len": lengths.float().mean().item(),
             "truncated_frac": (~ended).float().mean().item()}
    return rollouts, figures


@torch.inference_mode()
def generate_completions(model, tokenizer, prompts: list[str], G: int, *,
                         max_new_tokens: int, temperature: float):
    """G samples of each prompt, drawn from softmax(z_t / T) alone, with generate. Returns the
    prompts' ids (unpadded, one tensor each), the completions [P * G, max_len] on the CPU (prompt
    p's G samples in rows p*G to p*G + G - 1; generate pads each after its end) and the end token
    ids. Prompts are left-padded, so every completion starts at the same column.
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
    return prompt_ids, sequences[:, enc.input_ids.shape[1]:].cpu(), eos_ids


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


# ---- engineering: log mu recorded while generate samples (train.py --record-log-mu) ---------
def recording_sampler(fast=None, shared_prefill: bool = True):
    """generate_rollouts' sampler that records log mu while sampling: generate_recorded with these
    switches (train.py: --record-log-mu; fast with --fast-generation)."""
    return functools.partial(generate_recorded, fast=fast, shared_prefill=shared_prefill)


def run_sampler(record_log_mu: bool, fast=None):
    """The sampler train.py and its workers pass generate_rollouts: None (the method) unless
    --record-log-mu or a FastDecoding (--fast-generation) asks for the recorder."""
    return recording_sampler(fast=fast) if record_log_mu or fast is not None else None


@torch.inference_mode()
def generate_recorded(model, tokenizer, prompts: list[str], G: int, *, max_new_tokens: int,
                      temperature: float, fast=None, shared_prefill: bool = True):
    """generate_completions' samples, and log mu and mu's entropy of each token, [P * G, max_len]
    each, recorded while generate samples (BehaviourLogProbs), with no forward after. Returns
    generate_completions' three and those two. Engineering that gives the same samples faster:
      - shared_prefill=True: prefill_once builds the prompts' cache, each prompt token through the
        model once, not G times (tested: the same tokens);
      - fast: infra/fast_decoding.py's FastDecoding, a static KV cache kept for the run on a GPU.
    """
    check_bos(tokenizer, prompts)
    enc, prompt_ids = left_padded(tokenizer, prompts)
    eos_ids, pad_id = end_token_ids(model, tokenizer)
    gen_config = GenerationConfig(**PLAIN_SAMPLING, temperature=temperature,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
                                  pad_token_id=pad_id, compile_config=fast and fast.compile_config)
    recorder = BehaviourLogProbs(model, gen_config)     # it refuses dropout and changed sampling
    device = next(model.parameters()).device
    input_ids = enc.input_ids.repeat_interleave(G, dim=0).to(device)   # [P * G, prompt_len]
    attention_mask = enc.attention_mask.repeat_interleave(G, dim=0).to(device)
    extra = {} if fast is None else fast.generate_kwargs(input_ids.shape[0],
                                                         input_ids.shape[1] + max_new_tokens)
    if shared_prefill:      # the same samples, without prefilling each prompt G times
        input_ids, attention_mask, extra = prefill_once(
            model, prompt_ids, pad_id, G, cache=fast and extra[fast.cache_arg])
    # P * G completions, from the prefilled cache in extra if any; the recorder called once a token
    sequences = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                               generation_config=gen_config,
                               logits_processor=LogitsProcessorList([recorder]), **extra)
    completions = sequences[:, input_ids.shape[1]:]                  # [P * G, max_len]
    log_mu, mu_entropy = recorder.finish(completions)
    # what follows is per-rollout bookkeeping on small tensors: one copy to the CPU now, since
    # per-rollout indexing, .item() and .cpu() on a GPU would each wait for the device
    return prompt_ids, completions.cpu(), eos_ids, log_mu.cpu(), mu_entropy.cpu()


class BehaviourLogProbs(LogitsProcessor):
    """Records log mu(o_t) = log softmax(z_t / T)[o_t] of every sampled token while ``generate``
    runs, with no second forward. z_t are the logits that drew o_t and T is the temperature: the
    same distribution the loss evaluates. Memory O(batch * vocab), not O(batch * max_len * vocab).

    How it works. ``generate`` runs its logits processors in order, once per new token, then
    draws the token from the last one's output. It puts a processor passed in
    ``logits_processor`` (this one) after its penalties and before its warpers (temperature,
    top-k and the like; transformers 5.x). So this processor sees the raw logits z_t
    [batch, vocab] and divides by T itself. With every penalty and warper off, generate draws
    from softmax(z_t / T), the distribution recorded.

    The token o_t is drawn only after the processors ran, so its log mu is gathered one call
    later:
        call 1:  scores z_1                     keep log softmax(z_1 / T)      generate draws o_1
        call 2:  input_ids end with o_1         gather log mu(o_1) from it;
                 scores z_2                     keep log softmax(z_2 / T)      generate draws o_2
        ...
        finish(completions): the last token's log mu, from the last call's log-softmax
    Make one recorder per generate call. Use it through generate_recorded, which gives
    ``generate`` the generation_config the recorder was made with.

    Guards (in "the guards" below). At construction it refuses a generation_config, or a model's
    own config, that would sample from another distribution (``sampling_changes``: top_k not 0,
    top_p < 1, a repetition penalty, ...). At its first call, ``check_caller`` refuses a generate
    call that decodes greedily (no config given) or adds a sampling keyword of its own
    (``temperature=0.5``, ``top_k=5``). ``finish`` refuses completions whose tokens are not those
    it gathered (beam search reorders rows between calls).
    Engineering: on MPS, transformers runs one decode step more than it returns, so as not to
    wait on the device; ``finish`` drops that step.
    """

    def __init__(self, model, generation_config: GenerationConfig):
        refuse_active_dropout(model)
        refuse_sampling_changes(model, generation_config)
        # the T generate will sample at, found as generate finds it: the config's
        # (generate_recorded always sets it); if unset, the model's own generation_config's; else 1
        self.temperature = (generation_config.temperature or model.generation_config.temperature
                            or 1.0)
        self.prev_log_mu: torch.Tensor | None = None  # the last call's log softmax(z / T)
        self.log_mu: list[torch.Tensor] = []    # log mu of each token so far, each [batch]
        self.tokens: list[torch.Tensor] = []        # those tokens, each [batch]
        self.mu_entropy: list[torch.Tensor] = []    # mu's entropy there, each [batch]
        self.finished = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.finished:
            raise RuntimeError("this BehaviourLogProbs has finished: make a new one for each "
                               "generate call")
        if self.prev_log_mu is None:                  # the first call: the guard (below)
            check_caller(self, input_ids.shape[1])
        self._gather_prev(input_ids[:, -1])         # log mu of the token the last call drew
        log_mu_all = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # every token's
        self.mu_entropy.append(-(log_mu_all.exp() * log_mu_all).sum(-1))
        self.prev_log_mu = log_mu_all
        return scores                               # the distribution itself is left alone

    def _gather_prev(self, tokens: torch.Tensor) -> None:
        if self.prev_log_mu is not None:
            self.log_mu.append(self.prev_log_mu.gather(-1, tokens[:, None]).squeeze(-1))
            self.tokens.append(tokens)

    def finish(self, completions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_mu, entropy), each [batch, max_len], for ``completions`` [batch, max_len]
        (max_len: the tokens generate ran for, the longest completion). Refuses completions whose
        tokens are not those gathered call by call (beam search reorders rows between calls)."""
        max_len = completions.shape[1]
        if len(self.log_mu) < max_len:
            self._gather_prev(completions[:, -1])
        self.finished = True
        if not torch.equal(torch.stack(self.tokens[:max_len], 1), completions):
            raise ValueError("the completions are not the tokens whose log mu was recorded: "
                             "generate reordered its rows (beam search, num_beams > 1?); "
                             "BehaviourLogProbs records sampling only (num_beams=1)")
        return (torch.stack(self.log_mu[:max_len], 1),
                torch.stack(self.mu_entropy[:max_len], 1))


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
# the greedy evals' decoding: the argmax of z_t, none of a model's own penalties (an instruct
# model's repetition_penalty would otherwise apply to "greedy" accuracy)
PLAIN_GREEDY = dict(do_sample=False, num_beams=1, repetition_penalty=1.0,
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


def check_caller(recorder: BehaviourLogProbs, length: int) -> None:
    """The recorder's guard, run at its first call (length: the tokens of input_ids then).
    generate does not tell a logits processor what else it runs or whether it samples. So this
    guard reads them from generate's own frames on the call stack: the LogitsProcessorList that
    calls the recorder (its __call__'s self) and the decoding loop that calls that list
    (generate's _sample, its do_sample). check_processors then refuses what would not draw from
    the recorded softmax(z_t / T). This relies on transformers 5.x's private call structure;
    tests/test_traps.py checks it against the installed transformers. A recorder called some
    other way (directly, not from generate) is not checked."""
    recorder_call = sys._getframe(1)        # BehaviourLogProbs.__call__
    processors = recorder_call.f_back.f_locals.get("self")      # LogitsProcessorList.__call__
    decoding_loop = recorder_call.f_back.f_back                  # generate's _sample
    loop_name = decoding_loop.f_code.co_name if decoding_loop else None
    if isinstance(processors, LogitsProcessorList) and loop_name == "_beam_search":
        raise ValueError("generate is running beam search (num_beams > 1, given to generate): "
                         "BehaviourLogProbs records sampling only (num_beams=1)")
    check_processors(processors, recorder, length,
                     decoding_loop.f_locals.get("do_sample") if decoding_loop else None)


def check_processors(processors, recorder: BehaviourLogProbs, length: int,
                     do_sample: bool | None = None) -> None:
    """Refuses, in one line, what would make generate draw from another distribution than the
    recorded softmax(z_t / T): a decoding loop that does not sample (do_sample False: greedy, a
    generate call without the recorder's config); a temperature warper before the recorder (the
    recorder would divide by T twice); a sampling keyword given to generate itself (a temperature
    warper of another T, or none with T != 1; any other processor but a minimum length already
    reached). processors: the calling LogitsProcessorList (anything else, e.g. a direct call: no
    check); length: the tokens of input_ids now; do_sample: the decoding loop's (None: unknown)."""
    if not isinstance(processors, LogitsProcessorList):
        return
    if do_sample is False:
        raise ValueError("generate is decoding greedily (do_sample is not set), but the recorder "
                         "records log mu of sampling: give generate the generation_config the "
                         "recorder was made with (generate_recorded does)")
    T = recorder.temperature
    mine = next(i for i, p in enumerate(processors) if p is recorder)
    if any(isinstance(p, TemperatureLogitsWarper) for p in list(processors)[:mine]):
        raise ValueError("generate applies its temperature before the recorder, which divides by "
                         "T itself: this transformers orders its processors otherwise than 5.x")
    temperatures = [p.temperature for p in processors if isinstance(p, TemperatureLogitsWarper)]
    others = [type(p).__name__ for p in processors if p is not recorder
              and not isinstance(p, TemperatureLogitsWarper)
              and not (isinstance(p, MinLengthLogitsProcessor) and p.min_length <= length)]
    if others or temperatures != ([T] if T != 1.0 else []):
        raise ValueError(f"generate samples with temperature {temperatures or [1.0]} and "
                         f"{others or 'nothing else'}, but log mu is recorded at T = {T:g} "
                         "alone: put every sampling setting in the generation_config this "
                         "recorder is given, not in generate's keywords")


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


# ---- engineering: the same samples faster, each prompt prefilled once ----------------------
@torch.inference_mode()
def prefill_once(model, prompt_ids: list[torch.Tensor], pad_id: int, copies: int, cache=None):
    """The KV cache that ``generate`` would build from ``copies`` copies of each prompt, with each
    prompt token through the model once: (input_ids, attention_mask) [P * copies, columns] and
    {cache keyword: cache} of all columns but the last, for ``generate(input_ids=...,
    attention_mask=..., **cache)``, which runs the last column and samples from there. Layout: the
    first ``shared`` tokens, the same in every prompt (a system prompt), then each one's rest,
    left-padded: ids [P, columns] = [prefix | pad ... pad rest_i], mask = [1 .. 1 | 0 .. 0 1 .. 1],
    position = cumsum(mask) - 1 (as generate counts): each token at its unpadded position, attending
    to those before it, the distribution of left-padded copies up to rounding. The prefix (at most
    the shortest prompt - 1 tokens) runs once, batch 1, its rows repeated P times; the rests but
    their last column run on it; every row is then repeated ``copies`` times into ``cache`` (a
    DynamicCache; fast_decoding's StaticCache alike). Shared 0 and one copy: generate's own."""
    device = next(model.parameters()).device
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # transformers renamed the forward's cache argument (past_key_values -> cache) during 5.x
    keyword = ("cache" if "cache" in inspect.signature(base.forward).parameters
               else "past_key_values")
    lengths, rows = [len(ids) for ids in prompt_ids], [ids.tolist() for ids in prompt_ids]
    shared = 0
    while shared < min(lengths) - 1 and all(row[shared] == rows[0][shared] for row in rows):
        shared += 1
    width = max(lengths) - shared
    ids = torch.full((len(prompt_ids), shared + width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompt_ids):
        start = shared + width - (len(prompt) - shared)         # the rest's first column
        ids[row, :shared], ids[row, start:] = prompt[:shared], prompt[shared:]
        mask[row, :shared], mask[row, start:] = 1, 1
    if shared == 0 and copies == 1 and cache is None:   # nothing shared: generate prefills as usual
        return ids.to(device), mask.to(device), {}
    ids, mask = ids.to(device), mask.to(device)
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    forward = lambda span, batch, into: model(         # the cache of columns span, filled in place
        input_ids=ids[batch, span], attention_mask=mask[batch, :span.stop],
        position_ids=position[batch, span], use_cache=True, logits_to_keep=1, **{keyword: into})
    prompts = DynamicCache(config=base.config)
    if shared:
        forward(slice(0, shared), slice(0, 1), prefix := DynamicCache(config=base.config))
        prompts = repeat_rows(prefix, len(prompt_ids), prompts)
    if width > 1:
        forward(slice(shared, shared + width - 1), slice(None), prompts)
    if copies > 1 or cache is not None:
        into = DynamicCache(config=base.config) if cache is None else cache
        prompts = repeat_rows(prompts, copies, into)
    return ids.repeat_interleave(copies, 0), mask.repeat_interleave(copies, 0), {keyword: prompts}


def repeat_rows(cache, copies: int, into):
    """``into`` (an empty cache) given each layer's keys and values [rows, heads, len, dim] of
    ``cache`` with every row repeated ``copies`` times: [rows * copies, heads, len, dim]."""
    for index, layer in enumerate(cache.layers):
        if layer.is_initialized and layer.get_seq_length() > 0:
            into.update(layer.keys.repeat_interleave(copies, 0),
                        layer.values.repeat_interleave(copies, 0), index)
    return into


# ---- greedy evaluation (a reply leaves the batch once it ended) -----------------------------
def greedy_accuracy(model, tokenizer, prompts: list[str], reward_fn, *, max_new_tokens: int,
                    prompts_per_call: int = 256) -> float:
    """Mean reward of greedy completions (the eval accuracy when rewards are 0/1)."""
    return greedy_rewards(model, tokenizer, prompts, {"reward": reward_fn},
                          max_new_tokens=max_new_tokens,
                          prompts_per_call=prompts_per_call)["reward"]


@torch.inference_mode()
def greedy_rewards(model, tokenizer, prompts: list[str], reward_fns: dict, *, max_new_tokens: int,
                   prompts_per_call: int = 256, progress=None, shared_prefill: bool = True,
                   drop_ended: bool = True) -> dict[str, float]:
    """{name: mean reward} of one set of greedy completions, scored by each of ``reward_fns``.
    progress: e.g. a tqdm bar, advanced by the prompts of each batch done. Engineering, the same
    completions: shared_prefill, the tokens every prompt of a batch starts with (a system prompt)
    run once (``prefill_once``); drop_ended, a reply leaves the batch once it ended
    (``greedy_completions``)."""
    refuse_active_dropout(model)            # greedy through dropout scores another model
    device = next(model.parameters()).device
    check_bos(tokenizer, prompts)
    eos_ids, pad_id = end_token_ids(model, tokenizer)
    gen_config = GenerationConfig(**PLAIN_GREEDY, max_new_tokens=max_new_tokens,
                                  eos_token_id=eos_ids, pad_token_id=pad_id)
    totals = dict.fromkeys(reward_fns, 0.0)
    for start in range(0, len(prompts), prompts_per_call):
        chunk = prompts[start:start + prompts_per_call]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False)
        inputs, cache = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}, {}
        if shared_prefill:
            ids = enc.input_ids[enc.attention_mask.bool()].split(enc.attention_mask.sum(1).tolist())
            inputs["input_ids"], inputs["attention_mask"], cache = prefill_once(model, ids,
                                                                                 pad_id, 1)
        inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
        if drop_ended:
            new = greedy_completions(model, inputs, cache, gen_config)
        else:
            new = model.generate(**inputs, generation_config=gen_config,
                                 **cache)[:, inputs["input_ids"].shape[1]:].tolist()
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        for name, fn in reward_fns.items():
            totals[name] += sum(float(fn(p, t)) for p, t in zip(chunk, texts))
        if progress is not None:
            progress.update(len(chunk))
    return {name: total / len(prompts) for name, total in totals.items()}


def greedy_completions(model, inputs: dict, cache: dict, gen_config: GenerationConfig,
                       steps: int = 8) -> list[list[int]]:
    """Engineering: ``generate``'s greedy completions (each row's new tokens), a row leaving the
    batch once it holds an end token: generate runs ``steps`` tokens at a time, and between runs
    the ended rows are set aside and their rows of the KV cache dropped, so that a batch costs its
    replies' tokens rather than rows x the longest reply. Greedy decoding is the same whichever
    rows share the batch (up to rounding). inputs: input_ids, attention_mask [rows, prompt_len];
    cache: {keyword: the prompts' cache} (prefill_once's) or {} (generate builds one)."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    prompt_len = ids.shape[1]
    eos = torch.tensor(gen_config.eos_token_id, device=ids.device)
    rows, new = list(range(len(ids))), [None] * len(ids)
    config = copy.deepcopy(gen_config)
    config.return_dict_in_generate = True       # in the config: as a keyword, generate warns
    while True:
        config.max_new_tokens = min(steps, gen_config.max_new_tokens - (ids.shape[1] - prompt_len))
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **cache)
        ids = out.sequences                                  # [rows, prompt_len + tokens so far]
        for row, tokens in zip(rows, ids[:, prompt_len:].tolist()):
            new[row] = tokens
        ended = (torch.isin(ids[:, prompt_len:], eos).any(1)
                 | (ids.shape[1] - prompt_len >= gen_config.max_new_tokens))
        keep = (~ended).nonzero().squeeze(1)
        if not len(keep):
            return new
        rows, ids = [rows[i] for i in keep.tolist()], ids[keep]
        mask = torch.cat([mask, mask.new_ones(len(mask), ids.shape[1] - mask.shape[1])], 1)[keep]
        # transformers renamed the output's cache (past_key_values -> cache) during 5.x
        name = "cache" if getattr(out, "cache", None) is not None else "past_key_values"
        getattr(out, name).batch_select_indices(keep)     # the ended rows leave the cache too
        cache = {name: getattr(out, name)}
