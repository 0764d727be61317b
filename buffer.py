"""The replay buffer: a FIFO of single rollouts, sampled uniformly without removal.

It imports only torch and the standard library, so it can be copied into any project. Read it in
this order:
  - ``Rollout``: what travels from generation to the loss.
  - ``ReplayBuffer``: the paper's buffer. It adds with FIFO eviction, samples, and counts uses.
  - ``collate``: it pads a sampled batch for the forward (``padded_tokens``).
Below them, each after a marker line, come collate's guards (``check_rollouts``; copy them with
it), ``ReplayBufferWithVariants`` (variants, each off by
default: the paper's positive-bias retention, and this project's age limit, use limit and
zero-advantage filter) and the buffer's checkpoint form (``buffer_state``, ``load_buffer_state``).

A policy's version is the number of optimizer steps it has taken. Each rollout keeps the version
of the policy that generated it (``policy_version``). Its age is the current version minus its
own. collate returns it as ``age`` when it is given the current version. Tokens are stored unpadded,
one 1-D tensor per rollout. collate pads a batch only when it is used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


# eq=False makes equality identity. The generated __eq__ would compare tensors field by field, so
# `rollout in batch`, `batch.index(rollout)` and `batch.remove(rollout)` would raise ("Boolean
# value of Tensor with more than one value is ambiguous").
@dataclass(eq=False)
class Rollout:
    """One sampled completion, with everything the loss needs to replay it later.

    prompt_ids:      [its length] prompt token ids, no padding
    completion_ids:  [its length] completion token ids up to and including the first EOS, no
                     padding. There is no EOS when generation hit max_new_tokens.
    behaviour_logp:  [its length] log mu(o_t | o_<t): the log-prob of each completion token under
                     the policy that sampled it (mu), at the sampling temperature T
    reward:          the completion's scalar reward
    advantage:       A = (r - mean r) / (sample std r + 1e-4) in its group. It is fixed at
                     generation time and never recomputed.
    policy_version:  the version of the policy that generated it: the optimizer steps taken so
                     far, a skipped NaN/inf step included (ages count every step tried)
    baseline:        V, the mean reward of its group. Only asymre's r - (V - tau) reads it (tis
                     and ppo read A). No default: a default of 0 would pass asymre silently.
    temperature:     the T it was sampled at. The loss must take log pi_theta at the same T. No
                     default: a default of 1 would pass the loss's temperature check silently.
    uses:            how many training batches it has been part of so far
    """
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    behaviour_logp: torch.Tensor
    reward: float
    advantage: float
    policy_version: int
    baseline: float
    temperature: float
    uses: int = 0


class ReplayBuffer:
    """The paper's buffer: up to N = ``capacity`` rollouts, oldest first. ``add`` appends them;
    past N it evicts the oldest (FIFO). ``sample(B)`` draws B distinct rollouts uniformly at random
    and leaves them in the buffer. A rollout can be drawn again until it is evicted, and ``uses``
    counts how often it was drawn. ``left_by_uses`` counts the rollouts that have left by how often
    each was used ([unused, once, twice, ...]). It measures the replay ratio.
    seed: the sampler's seed. None (the default) draws a fresh one, so two buffers draw different
    batches. Pass a seed for a run that repeats (train.py passes --seed)."""

    def __init__(self, capacity: int, seed: int | None = None):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.items: list[Rollout] = []              # oldest first
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()                   # from the OS's entropy, a stream of its own
        else:
            self.generator.manual_seed(seed)
        self.left_by_uses: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, rollouts: list[Rollout]) -> int:
        """Append rollouts, oldest first. Past capacity the oldest leave. Returns how many were
        stored: all of them here (ReplayBufferWithVariants' filter and limit may store fewer).
        Adding more than the capacity at once raises, because the first ones would leave before
        any batch used them."""
        if len(rollouts) > self.capacity:
            raise ValueError(f"{len(rollouts)} rollouts added to a buffer of {self.capacity}: "
                             f"the first {len(rollouts) - self.capacity} would be evicted before "
                             "any batch used them")
        self.items = self.items + rollouts
        if len(self.items) > self.capacity:
            self.evict()
        return len(rollouts)

    def evict(self) -> None:
        """Evict the oldest rollouts (FIFO) until the buffer is down to capacity."""
        self.count_leaving(self.items[:-self.capacity])
        self.items = self.items[-self.capacity:]

    def sample(self, batch_size: int) -> list[Rollout]:
        """Draw B distinct rollouts uniformly at random. Their use counts go up, and they stay in
        the buffer."""
        if batch_size > len(self.items):
            raise ValueError(f"cannot sample {batch_size} rollouts from a buffer of "
                             f"{len(self.items)}")
        idx = torch.randperm(len(self.items), generator=self.generator)[:batch_size].tolist()
        sampled = [self.items[i] for i in idx]
        for rollout in sampled:
            rollout.uses += 1
        return sampled

    def count_leaving(self, rollouts: list[Rollout]) -> None:
        """Count the rollouts leaving the buffer by how often each was used."""
        for rollout in rollouts:
            if rollout.uses >= len(self.left_by_uses):
                self.left_by_uses += [0] * (rollout.uses + 1 - len(self.left_by_uses))
            self.left_by_uses[rollout.uses] += 1


def collate(rollouts: list[Rollout], pad_id: int, current_version: int | None = None,
            device: torch.device | str | None = None, *,
            eos_ids: list[int]) -> dict[str, torch.Tensor | float]:
    """Pad a list of rollouts into one batch for a training forward.

    Prompts are left-padded and completions right-padded, so every completion starts at the
    same column (prompt_len = the longest prompt):   [pad pad p p p | c c c EOS pad]
    Returns, with batch = len(rollouts) and max_len = the longest completion:
      input_ids, attention_mask, position_ids: [batch, prompt_len + max_len]
      completion_mask:  [batch, max_len]  1 on real completion tokens (EOS included), 0 on
                        padding
      behaviour_logp:   [batch, max_len]  (0 on padding)
      advantage, reward, baseline:  [batch]
      temperature:      the T they were sampled at, a float. Rollouts of different T raise.
      age:              [batch]  the current policy's version (current_version) minus each
                        rollout's. Only when current_version is given: a default of 0 would give
                        negative ages.
    position_ids count real tokens only, exactly as generate() numbers them under left padding.
    device: where the tensors go (default: the CPU).
    eos_ids: the ids that end a completion (the tokenizer's EOS and any the model lists;
    rollout.end_token_ids gives them). completion_mask is 1 on a completion's whole length, so a
    token stored after its first end token (a pad) would be trained on.
    The guards refuse a prompt that begins or ends with pad_id; a completion with a token after
    its first end token, or one that ends with pad_id twice (a padded row that has no end token);
    and a behaviour_logp that is not one log mu per completion token. They cannot see prompts padded
    with another id (eos where the tokenizer pads with <pad>): they pass, and the pads are read as
    prompt tokens. Pass the pad id the prompts were padded with. Nor a completion stored without
    its EOS: it looks like one cut at max_new_tokens, and the EOS is never trained on.
    So store each rollout trimmed: the prompt's own tokens, and the completion up to and
    including its first end token.
    """
    temperature = check_rollouts(rollouts, pad_id, eos_ids)     # the guards, below
    cols = {**padded_tokens(rollouts, pad_id),
            "advantage": torch.tensor([rollout.advantage for rollout in rollouts],
                                      dtype=torch.float32),
            "reward": torch.tensor([rollout.reward for rollout in rollouts], dtype=torch.float32),
            "baseline": torch.tensor([rollout.baseline for rollout in rollouts],
                                     dtype=torch.float32),
            "temperature": temperature}
    if current_version is not None:
        age = torch.tensor([current_version - rollout.policy_version for rollout in rollouts],
                           dtype=torch.float32)
        if (age < 0).any():
            raise ValueError(f"current_version {current_version} is older than a rollout's "
                             f"{max(rollout.policy_version for rollout in rollouts)}: "
                             "pass the policy's optimizer steps so far")
        cols["age"] = age
    if device is not None:
        cols = {k: v.to(device) if torch.is_tensor(v) else v for k, v in cols.items()}
    return cols


def padded_tokens(rollouts: list[Rollout], pad_id: int) -> dict[str, torch.Tensor]:
    """collate's token tensors. input_ids, attention_mask, position_ids: [batch, prompt_len +
    max_len]. completion_mask, behaviour_logp: [batch, max_len]."""
    prompt_len = max(len(rollout.prompt_ids) for rollout in rollouts)
    max_len = max(len(rollout.completion_ids) for rollout in rollouts)
    n = len(rollouts)
    input_ids = torch.full((n, prompt_len + max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, prompt_len + max_len), dtype=torch.long)
    behaviour_logp = torch.zeros((n, max_len))
    for i, rollout in enumerate(rollouts):
        start = prompt_len - len(rollout.prompt_ids)              # left-padded prompt
        end = prompt_len + len(rollout.completion_ids)            # right-padded completion
        input_ids[i, start:prompt_len] = rollout.prompt_ids
        input_ids[i, prompt_len:end] = rollout.completion_ids
        attention_mask[i, start:end] = 1
        behaviour_logp[i, :len(rollout.completion_ids)] = rollout.behaviour_logp
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            # positions count real tokens only, as generate numbers them
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "completion_mask": attention_mask[:, prompt_len:].float(),
            "behaviour_logp": behaviour_logp}


# ---- collate's guards ------------------------------------------------------------------------
def check_rollouts(rollouts: list[Rollout], pad_id: int, eos_ids: list[int]) -> float:
    """Refuses, in one line each, rollouts that collate would turn into wrong columns (its
    docstring lists them); returns the temperature they were all sampled at."""
    if any(len(r.prompt_ids) == 0 for r in rollouts):
        raise ValueError("a rollout with an empty prompt: its first completion token has no "
                         "position before it to be scored from (begin each prompt with a BOS)")
    if any(pad_id in (int(r.prompt_ids[0]), int(r.prompt_ids[-1])) for r in rollouts):
        raise ValueError(f"a rollout's prompt_ids begin or end with the pad id {pad_id}: store "
                         "each prompt unpadded (not a row of a padded batch), else the pads are "
                         "read as prompt tokens and log pi_theta no longer matches log mu")
    if any(r.behaviour_logp.shape != r.completion_ids.shape for r in rollouts):
        raise ValueError("a rollout's behaviour_logp is not one log mu per completion token (a "
                         "whole sequence's log-prob, as some servers return, would be spread over "
                         "every token): store log mu(o_t) of each token")
    # with pad == eos one trailing pad is the EOS itself, so two mark a padded row
    if any(r.completion_ids[-2:].tolist() == [pad_id, pad_id] for r in rollouts):
        raise ValueError(f"a rollout's completion_ids end with the pad id {pad_id} twice: store "
                         "each completion up to and including its first EOS, not a padded row")
    # an end token anywhere but last: tokens follow the completion's end
    before_last = torch.cat([r.completion_ids[:-1] for r in rollouts])
    ends = torch.as_tensor(eos_ids, dtype=torch.long, device=before_last.device)
    if torch.isin(before_last, ends).any():
        raise ValueError("a rollout's completion has tokens after its first end token "
                         f"(eos_ids {ends.tolist()}): store each completion up to and "
                         "including its first end token, else what follows is trained on")
    temperatures = {rollout.temperature for rollout in rollouts}
    if len(temperatures) > 1:
        raise ValueError(f"rollouts sampled at temperatures {sorted(temperatures)} in one batch: "
                         "the loss takes log pi_theta at one temperature, the one they were "
                         "sampled at")
    return temperatures.pop()


# ---- variants: the paper's and ours, each off by default ---------------------------------------
class ReplayBufferWithVariants(ReplayBuffer):
    """ReplayBuffer with the variants that train.py's flags turn on. With all of them off, it is
    ReplayBuffer.
      max_age                 drop rollouts older than this many optimizer steps. ``sample`` then
                              needs the current version (``current_version``) and drops them
                              before it draws. ``drop_stale`` drops them on its own.
      sample(B, max_uses=U)   a cap on reuse: a rollout used U times leaves, however many batches
                              are drawn from what is held. ``remove`` is U = 1: each is used once.
      keep_correct_frac = delta > 0   positive-bias retention (the paper's). When the buffer is
                              full, it keeps the freshest (1 - delta) * N rollouts, at least those
                              of the latest add. The other slots go to the freshest *correct*
                              older ones (reward >= correct_reward, which it requires: the reward
                              of a correct rollout on the task's scale, 1.0 for a 0/1 reward),
                              then to the freshest other older ones. So the buffer stays full.
      skip_zero_advantage     never store rollouts of advantage 0 (their group's rewards were all
                              equal). This is right only for losses that get no gradient from
                              them, so it needs the loss named (loss_type, beta; see
                              zero_advantage_filter_fits). It also makes each step larger: under
                              token_mean their tokens leave the normalizer, so the same gradient
                              is divided by fewer tokens, 1 / (1 - the share dropped) times more
                              (twice, with half the tokens dropped): an effective lr change.
      add(rollouts, limit)    store the first ``limit`` of them (None: all) and drop the rest.
                              It returns how many it stored; train.py reports the rest as
                              dropped. train.py passes a limit with --new-per-update, so that S
                              are stored per K steps.
    """

    def __init__(self, capacity: int, seed: int | None = None, *, max_age: int | None = None,
                 keep_correct_frac: float = 0.0, skip_zero_advantage: bool = False,
                 loss_type: str | None = None, beta: float = 0.0,
                 correct_reward: float | None = None):
        super().__init__(capacity, seed)
        if skip_zero_advantage and not zero_advantage_filter_fits(loss_type, beta):
            raise ValueError(f"skip_zero_advantage with loss_type {loss_type!r}, beta {beta}: "
                             "the filter is only for tis or ppo without KL (beta 0), which get no "
                             "gradient from a rollout of A = 0; asymre (coefficient tau) and the "
                             "KL term do")
        if max_age is not None and max_age < 1:
            raise ValueError(f"max_age {max_age}: None is no limit; 0 would drop every rollout "
                             "one step after it was generated (no reuse at all)")
        if not 0 <= keep_correct_frac < 1:
            raise ValueError(f"keep_correct_frac must be in [0, 1), got {keep_correct_frac}")
        if keep_correct_frac and correct_reward is None:    # a default would fit one scale only
            raise ValueError("keep_correct_frac needs correct_reward: the reward a correct rollout "
                             "gets on your task's scale (1.0 for a 0/1 reward)")
        self.max_age, self.keep_correct_frac = max_age, keep_correct_frac
        self.skip_zero_advantage, self.correct_reward = skip_zero_advantage, correct_reward
        self.newest = 0                             # how many the latest add stored

    def add(self, rollouts: list[Rollout], limit: int | None = None) -> int:
        """ReplayBuffer.add, after the zero-advantage filter and the limit."""
        if self.skip_zero_advantage:
            rollouts = [rollout for rollout in rollouts if rollout.advantage != 0]
        if limit is not None:
            rollouts = rollouts[:max(limit, 0)]
        self.newest = len(rollouts)
        return super().add(rollouts)

    def evict(self) -> None:
        if self.keep_correct_frac:
            self.evict_keeping_correct(self.newest)
        else:
            super().evict()

    def evict_keeping_correct(self, n_new: int) -> None:
        """A variant, positive-bias retention. Keep the freshest (1 - delta) * N, and never fewer
        than the n_new just added. An earlier add's unused rollouts are not protected. Fill the
        other slots with the freshest correct older ones (reward >= correct_reward), then with
        the freshest other older ones."""
        n_fresh = min(self.capacity,
                      max(self.capacity - int(self.keep_correct_frac * self.capacity), n_new))
        older, fresh = self.items[:-n_fresh], self.items[-n_fresh:]
        slots = self.capacity - n_fresh
        if slots == 0:
            self.count_leaving(older)
            self.items = fresh
            return
        # rank the older rollouts: correct ones first, then the rest, freshest first in each
        newest_first = list(range(len(older) - 1, -1, -1))
        correct = [i for i in newest_first if older[i].reward >= self.correct_reward]
        ranked = correct + [i for i in newest_first if older[i].reward < self.correct_reward]
        kept = sorted(ranked[:slots])
        self.count_leaving([older[i] for i in ranked[slots:]])
        self.items = [older[i] for i in kept] + fresh

    def drop_stale(self, current_version: int) -> int:
        """A variant: evict rollouts older than max_age optimizer steps. Returns how many were
        dropped. ``sample(B, current_version=...)`` runs it first. Call it alone to drop them
        earlier. train.py does so after each add, so that the rollouts it counts as held are
        fresh enough."""
        if self.max_age is None:
            return 0
        stale = [rollout for rollout in self.items
                 if current_version - rollout.policy_version > self.max_age]
        self.items = [rollout for rollout in self.items
                      if current_version - rollout.policy_version <= self.max_age]
        self.count_leaving(stale)
        return len(stale)

    def sample(self, batch_size: int, remove: bool = False, max_uses: int | None = None,
               current_version: int | None = None) -> list[Rollout]:
        """ReplayBuffer.sample with two variants. Before the draw it drops stale rollouts
        (max_age), which needs current_version, the current policy's steps. After the draw it
        applies the cap on uses (max_uses, remove)."""
        if max_uses is not None and max_uses < 1:
            raise ValueError(f"max_uses {max_uses}: None is no cap; below 1 nothing could be used")
        if remove and max_uses is not None:
            raise ValueError(f"remove with max_uses {max_uses}: remove is max_uses = 1; give one")
        if self.max_age is not None:
            if current_version is None:
                raise ValueError(f"max_age {self.max_age}: pass sample(..., current_version=) "
                                 "(the current policy's steps), else no stale rollout is dropped")
            self.drop_stale(current_version)
        sampled = super().sample(batch_size)
        cap = 1 if remove else max_uses
        if cap is not None:
            done = [rollout for rollout in self.items if rollout.uses >= cap]
            self.count_leaving(done)
            self.items = [rollout for rollout in self.items if rollout.uses < cap]
        return sampled


def zero_advantage_filter_fits(loss_type: str | None, beta: float) -> bool:
    """Whether rollouts of A = 0 carry no gradient under this loss, so that skip_zero_advantage
    drops none that has one. That holds for tis and ppo without the KL term. asymre weighs them by
    tau, and the KL term by beta. The step still changes. Under token_mean their tokens leave the
    normalizer, so the same gradient is divided by fewer tokens. It grows by 1 / (1 - the share of
    tokens dropped)."""
    return loss_type in ("tis", "ppo") and not beta > 0


# ---- the buffer's checkpoint form: a flat dict of tensors (safetensors can write it) -----------
def buffer_state(buffer: ReplayBuffer) -> dict[str, torch.Tensor]:
    """The buffer as a flat dict of tensors, which safetensors can write. It holds the rollouts,
    their use counts, the sampler's state, and the count of those gone by uses."""
    items = buffer.items
    cat = lambda xs, dtype: torch.cat(xs) if xs else torch.zeros(0, dtype=dtype)
    return {
        "prompt_ids": cat([rollout.prompt_ids for rollout in items], torch.long),
        "prompt_lens": torch.tensor([len(rollout.prompt_ids) for rollout in items],
                                    dtype=torch.long),
        "completion_ids": cat([rollout.completion_ids for rollout in items], torch.long),
        "behaviour_logp": cat([rollout.behaviour_logp for rollout in items], torch.float32),
        "completion_lens": torch.tensor([len(rollout.completion_ids) for rollout in items],
                                        dtype=torch.long),
        "reward": torch.tensor([rollout.reward for rollout in items], dtype=torch.float64),
        "advantage": torch.tensor([rollout.advantage for rollout in items],
                                  dtype=torch.float64),
        "policy_version": torch.tensor([rollout.policy_version for rollout in items],
                                       dtype=torch.long),
        "baseline": torch.tensor([rollout.baseline for rollout in items], dtype=torch.float64),
        "uses": torch.tensor([rollout.uses for rollout in items], dtype=torch.long),
        "temperature": torch.tensor([rollout.temperature for rollout in items],
                                    dtype=torch.float64),
        "generator_state": buffer.generator.get_state(),
        "left_by_uses": torch.tensor(buffer.left_by_uses, dtype=torch.long),
    }


def load_buffer_state(buffer: ReplayBuffer, state: dict[str, torch.Tensor],
                      temperature: float | None = None) -> None:
    """Put ``buffer_state``'s contents into a buffer of at least that capacity. temperature: the T
    of a buffer saved before rollouts kept their own T (the run's --temperature). Such a buffer
    raises without it."""
    prompts = torch.split(state["prompt_ids"], state["prompt_lens"].tolist())
    completions = torch.split(state["completion_ids"], state["completion_lens"].tolist())
    logps = torch.split(state["behaviour_logp"], state["completion_lens"].tolist())
    if "temperature" in state:
        temperatures = state["temperature"].tolist()
    elif temperature is None:
        raise ValueError("this buffer was saved before rollouts kept their temperature: pass "
                         "the T they were sampled at")
    else:
        temperatures = [temperature] * len(prompts)
    if len(prompts) > buffer.capacity:
        raise ValueError(f"a state of {len(prompts)} rollouts into a buffer of capacity "
                         f"{buffer.capacity}: build the buffer as large as the one saved")
    buffer.items = [Rollout(p.clone(), c.clone(), lp.clone(), reward=state["reward"][i].item(),
                          advantage=state["advantage"][i].item(),
                          policy_version=int(state["policy_version"][i]),
                          baseline=state["baseline"][i].item(), uses=int(state["uses"][i]),
                          temperature=temperatures[i])
                  for i, (p, c, lp) in enumerate(zip(prompts, completions, logps))]
    buffer.generator.set_state(state["generator_state"])
    # a checkpoint saved before this count existed: none counted as gone
    buffer.left_by_uses = state["left_by_uses"].tolist() if "left_by_uses" in state else []
