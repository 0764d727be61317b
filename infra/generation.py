"""Engineering of generation, for rollout.py: the same completions and log mu as its method, or
the same greedy completions, faster. Nothing here is needed to learn the method (rollout.py).

  - recording_sampler / generate_recorded (train.py --record-log-mu; --fast-generation and
    --model smollm2 take it too): log mu recorded while generate samples (the recorder
    BehaviourLogProbs), so that no forward follows generate. generate_rollouts takes it as its
    sampler. The recorder relies on the order in which transformers 5.x runs its logits
    processors, which its guard checks (check_caller, check_processors). The same completions
    and log mu as rollout.forward_log_mu's (tested).
  - prefill_once: the prompts' KV cache with each prompt token through the model once, not G
    times (the same tokens, tested).
  - greedy_accuracy / greedy_rewards: the held-out evals (train.py's, evaluate.py's), a reply
    leaving the batch once it ended (greedy_completions).
"""
from __future__ import annotations

import copy
import functools
import inspect
import sys

import torch
from transformers import (DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList,
                          MinLengthLogitsProcessor, TemperatureLogitsWarper)

from replay_rl import refuse_active_dropout
from rollout import (PLAIN_SAMPLING, check_bos, end_token_ids, left_padded,
                     refuse_sampling_changes)


# ---- log mu recorded while generate samples (train.py --record-log-mu) ---------------------
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
    (prompt_ids, completions, group, eos_ids, log_mu, mu_entropy), the first four as
    generate_completions returns them (rows prompt-major: group = row // G). Engineering that
    gives the same samples faster:
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
    group = torch.arange(len(completions)) // G                          # row i answers i // G
    return prompt_ids, completions.cpu(), group, eos_ids, log_mu.cpu(), mu_entropy.cpu()


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


# ---- the recorder's guard: generate draws from the recorded softmax(z_t / T) ---------------
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


# ---- the same samples faster, each prompt prefilled once ------------------------------------
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
# the greedy evals' decoding: the argmax of z_t, none of a model's own penalties (an instruct
# model's repetition_penalty would otherwise apply to "greedy" accuracy)
PLAIN_GREEDY = dict(do_sample=False, num_beams=1, repetition_penalty=1.0,
                    encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
                    encoder_no_repeat_ngram_size=0, min_new_tokens=0, guidance_scale=1.0)


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
