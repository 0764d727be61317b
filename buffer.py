"""A compact FIFO replay buffer of individual rollouts.

Imports only torch and the standard library, so it can be copied into any project.

The buffer holds up to ``capacity`` rollouts; adding more evicts the oldest first (FIFO).
``sample(B)`` draws B *distinct* rollouts uniformly at random *without removing them*,
so every rollout can be used several times before it is evicted. The average number of
uses is the replay ratio. Each rollout keeps the policy version that generated it, so
its age (current version - generating version, in optimizer steps) is known when it is
replayed (one name for the count of optimizer steps: ``policy_version``, the rollout's and the
current policy's; train.py's ``step`` is the same count). ``max_age`` optionally drops rollouts
that have grown too stale: ``sample`` then needs the current ``policy_version`` and drops them
before it draws (``drop_stale`` does it alone).

Variants (off by default; the method is the plain FIFO above), from the paper's discussion:
  max_age                         the staleness cap above (sample(B, policy_version=...));
  sample(B, max_uses=U)           a cap on reuse: a rollout used U times leaves (U = 1: each
                                  used once), however many batches are drawn from what is held;
  keep_correct_frac = delta > 0   positive-bias retention (delta: the part of the N slots kept
                                  for older correct rollouts): when full, keep the freshest
                                  (1 - delta) * N rollouts (at least those of the latest add(),
                                  unused; with several adds before a draw, an earlier add's
                                  unused ones can go, which FIFO would keep) plus, in the other
                                  slots, the freshest *correct* older rollouts (reward >=
                                  correct_reward, default 1.0: a task's full reward, not merely
                                  > 0); slots that correct ones cannot fill go to the freshest
                                  other older ones, so the buffer stays full;
  skip_zero_advantage             never store rollouts whose advantage is 0 (their group's
                                  rewards were all equal): right only for losses that get no
                                  gradient from them, so it needs the loss named (loss_type, beta)
                                  and refuses asymre (coefficient tau there) and beta > 0 (the KL).

Tokens are stored unpadded (one 1-D tensor per rollout); ``collate`` pads a sampled
batch only when it is used. Of the rollouts that have left the buffer, it counts how often each had
been used (``left_by_uses``): the replay ratio as measured. Its planned value y = K*B/R counts as R
the rollouts *stored* a round: the filter stores fewer than are generated, and the staleness cap
drops some before they are used that often.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


# eq=False: equality is identity. The generated __eq__ would compare tensors field by field, and
# `rollout in batch`, `batch.index(rollout)` and `batch.remove(rollout)` would raise ("Boolean value
# of Tensor with more than one value is ambiguous").
@dataclass(eq=False)
class Rollout:
    """One sampled completion and everything the loss needs to replay it later.

    prompt_ids:      [its length] prompt token ids (no padding)
    completion_ids:  [its length] completion token ids, up to and including the first EOS
                     (no EOS when generation hit max_new_tokens); no padding
    behaviour_logp:  [its length] log mu(o_t | o_<t): log-prob of each completion token under
                     the policy that sampled it (mu), at the sampling temperature T
    reward:          scalar reward of the completion
    advantage:       A = (r - mean r) / (sample std r + 1e-4) in its group, fixed at generation
                     time (never recomputed)
    policy_version:  optimizer steps taken by the policy that generated it
    baseline:        V, the mean reward of its group (AsymRE's r - (V - tau) needs it)
    temperature:     T it was sampled at: the loss must take log pi_theta at the same T
    uses:            how many training batches it has been part of so far
    baseline and temperature have no default: a default of 0 or 1 that the loss reads would pass
    its guards silently (AsymRE's coefficient, the temperature check).
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


def zero_advantage_filter_fits(loss_type: str | None, beta: float) -> bool:
    """Whether rollouts of A = 0 carry no gradient under this loss, so skip_zero_advantage drops
    none that has one: tis and ppo without the KL term (asymre weighs them by tau, the KL term by
    beta). The step still changes: under token_mean their tokens leave the normalizer, so the same
    gradient is divided by fewer tokens (1 / (1 - the share of tokens dropped) larger)."""
    return loss_type in ("tis", "ppo") and not beta > 0


class ReplayBuffer:
    """FIFO of up to ``capacity`` (N) rollouts, sampled uniformly without removal.

    max_age (optimizer steps): ``sample`` then requires ``policy_version`` (the current policy's)
    and drops the rollouts older than max_age before it draws; ``drop_stale`` drops them alone.
    seed: of the sampler; None (the default) draws a fresh one, so two buffers draw different
    batches; pass one for a run that repeats (train.py passes --seed).
    correct_reward: with keep_correct_frac, a rollout counts as correct when its reward is at
    least this (1.0: the full reward of a 0/1 task); set it to your task's full reward.
    """

    def __init__(self, capacity: int, max_age: int | None = None, seed: int | None = None,
                 keep_correct_frac: float = 0.0, skip_zero_advantage: bool = False,
                 loss_type: str | None = None, beta: float = 0.0, correct_reward: float = 1.0):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
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
        self.capacity = capacity
        self.max_age = max_age
        self.keep_correct_frac = keep_correct_frac
        self.correct_reward = correct_reward
        self.skip_zero_advantage = skip_zero_advantage
        self.items: list[Rollout] = []              # oldest first
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()                   # from the OS's entropy: a stream of its own
        else:
            self.generator.manual_seed(seed)
        # rollouts gone, by uses: [unused, once, twice, ...]
        self.left_by_uses: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, rollouts: list[Rollout], limit: int | None = None) -> int:
        """Append rollouts (oldest first); once over capacity, evict (FIFO, or positive-bias).
        limit: store at most this many (the first, after the filter). Returns how many were
        stored."""
        if self.skip_zero_advantage:        # a variant: store none of zero advantage
            rollouts = [rollout for rollout in rollouts if rollout.advantage != 0]
        if limit is not None:
            rollouts = rollouts[:max(limit, 0)]
        if len(rollouts) > self.capacity:
            raise ValueError(f"{len(rollouts)} rollouts added to a buffer of {self.capacity}: "
                             f"the first {len(rollouts) - self.capacity} would be evicted before "
                             "any batch used them")
        self.items = self.items + rollouts
        if len(self.items) > self.capacity:
            self.evict(len(rollouts))
        return len(rollouts)

    def evict(self, n_new: int) -> None:
        """Down to capacity: the freshest N leave last (FIFO), or with keep_correct_frac the
        variant below."""
        if not self.keep_correct_frac:
            self.count_leaving(self.items[:-self.capacity])
            self.items = self.items[-self.capacity:]
            return
        self.evict_keeping_correct(n_new)

    def evict_keeping_correct(self, n_new: int) -> None:
        """A variant, positive-bias retention: keep the freshest (1 - delta) * N, never fewer than
        the n_new just added (an earlier add's unused rollouts are not protected), plus in the
        other slots the freshest correct older ones (reward >= correct_reward), then the freshest
        other older ones."""
        n_fresh = min(self.capacity,
                      max(self.capacity - int(self.keep_correct_frac * self.capacity), n_new))
        older, fresh = self.items[:-n_fresh], self.items[-n_fresh:]
        slots = self.capacity - n_fresh
        if slots == 0:
            self.count_leaving(older)
            self.items = fresh
            return
        # the older rollouts to keep: correct ones first, then the rest, each freshest first
        newest_first = list(range(len(older) - 1, -1, -1))
        correct = [i for i in newest_first if older[i].reward >= self.correct_reward]
        ranked = correct + [i for i in newest_first if older[i].reward < self.correct_reward]
        kept = sorted(ranked[:slots])
        self.count_leaving([older[i] for i in ranked[slots:]])
        self.items = [older[i] for i in kept] + fresh

    def drop_stale(self, policy_version: int) -> int:
        """A variant: evict rollouts older than max_age optimizer steps. Returns how many were
        dropped. ``sample(B, policy_version=...)`` runs it first; call it alone to drop them
        earlier (train.py does after each add, so that what is counted held is fresh enough)."""
        if self.max_age is None:
            return 0
        stale = [rollout for rollout in self.items
                 if policy_version - rollout.policy_version > self.max_age]
        self.items = [rollout for rollout in self.items
                      if policy_version - rollout.policy_version <= self.max_age]
        self.count_leaving(stale)
        return len(stale)

    def count_leaving(self, rollouts: list[Rollout]) -> None:
        """Rollouts leaving the buffer, counted by how often each had been used."""
        for rollout in rollouts:
            if rollout.uses >= len(self.left_by_uses):
                self.left_by_uses += [0] * (rollout.uses + 1 - len(self.left_by_uses))
            self.left_by_uses[rollout.uses] += 1

    def sample(self, batch_size: int, remove: bool = False, max_uses: int | None = None,
               policy_version: int | None = None) -> list[Rollout]:
        """B distinct rollouts, uniformly at random; their use counts go up. They stay in the
        buffer for later batches (replay), unless ``remove``: then each rollout is used once.
        A variant: ``max_uses`` U, a rollout used U times leaves (remove is U = 1), so no rollout
        is trained on more than U times however many batches are drawn.
        policy_version: the current policy's optimizer steps; with max_age it is required, and the
        rollouts older than max_age leave before the draw."""
        if max_uses is not None and max_uses < 1:
            raise ValueError(f"max_uses {max_uses}: None is no cap; below 1 nothing could be used")
        if remove and max_uses is not None:
            raise ValueError(f"remove with max_uses {max_uses}: remove is max_uses = 1; give one")
        if self.max_age is not None:
            if policy_version is None:
                raise ValueError(f"max_age {self.max_age}: pass sample(..., policy_version=) "
                                 "(the current policy's steps), else no stale rollout is dropped")
            self.drop_stale(policy_version)
        if batch_size > len(self.items):
            raise ValueError(f"cannot sample {batch_size} rollouts from a buffer of "
                             f"{len(self.items)}")
        idx = torch.randperm(len(self.items), generator=self.generator)[:batch_size].tolist()
        sampled = [self.items[i] for i in idx]
        for rollout in sampled:
            rollout.uses += 1
        cap = 1 if remove else max_uses
        if cap is not None:
            done = {i for i in idx if self.items[i].uses >= cap}
            self.count_leaving([self.items[i] for i in sorted(done)])
            self.items = [rollout for i, rollout in enumerate(self.items) if i not in done]
        return sampled

    # ---- checkpointing: a flat dict of tensors (safetensors-compatible) -------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        items = self.items
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
            "generator_state": self.generator.get_state(),
            "left_by_uses": torch.tensor(self.left_by_uses, dtype=torch.long),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor],
                        temperature: float | None = None) -> None:
        """The buffer of ``state_dict``. temperature: the T of a buffer saved before rollouts kept
        their own (the run's --temperature); such a buffer without it raises."""
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
        if len(prompts) > self.capacity:
            raise ValueError(f"a state of {len(prompts)} rollouts into a buffer of capacity "
                             f"{self.capacity}: build the buffer as large as the one saved")
        self.items = [Rollout(p.clone(), c.clone(), lp.clone(), reward=state["reward"][i].item(),
                              advantage=state["advantage"][i].item(),
                              policy_version=int(state["policy_version"][i]),
                              baseline=state["baseline"][i].item(), uses=int(state["uses"][i]),
                              temperature=temperatures[i])
                      for i, (p, c, lp) in enumerate(zip(prompts, completions, logps))]
        self.generator.set_state(state["generator_state"])
        # a checkpoint older than this count: none counted as gone
        self.left_by_uses = state["left_by_uses"].tolist() if "left_by_uses" in state else []


def collate(rollouts: list[Rollout], pad_id: int, policy_version: int | None = None,
            device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Pad a list of rollouts into one batch for a training forward.

    Prompts are left-padded and completions right-padded, so every completion starts at the
    same column (prompt_len = the longest prompt):   [pad pad p p p | c c c EOS pad]
    Returns, with batch = len(rollouts) and max_len = the longest completion:
      input_ids, attention_mask, position_ids: [batch, prompt_len + max_len]
      completion_mask:  [batch, max_len]  1 on real completion tokens (EOS included), 0 on
                        padding
      behaviour_logp:   [batch, max_len]  (0 on padding)
      advantage, reward, baseline:  [batch]
      temperature:      the T they were sampled at (a float; rollouts of different T raise)
      age:              [batch]  policy_version (the current policy's) minus each rollout's, only
                        when policy_version is given (a default of 0 would give negative ages)
    position_ids count real tokens only, exactly as generate() numbers them under left padding.
    device: where the tensors go (default: the CPU).
    """
    temperatures = {rollout.temperature for rollout in rollouts}
    if len(temperatures) > 1:
        raise ValueError(f"rollouts sampled at temperatures {sorted(temperatures)} in one batch: "
                         "the loss takes log pi_theta at one temperature, the one they were "
                         "sampled at")
    cols = {**padded_tokens(rollouts, pad_id),
            "advantage": torch.tensor([rollout.advantage for rollout in rollouts],
                                      dtype=torch.float32),
            "reward": torch.tensor([rollout.reward for rollout in rollouts], dtype=torch.float32),
            "baseline": torch.tensor([rollout.baseline for rollout in rollouts],
                                     dtype=torch.float32),
            "temperature": temperatures.pop()}
    if policy_version is not None:
        age = torch.tensor([policy_version - rollout.policy_version for rollout in rollouts],
                           dtype=torch.float32)
        if (age < 0).any():
            raise ValueError(f"policy_version {policy_version} is older than a rollout's "
                             f"{max(rollout.policy_version for rollout in rollouts)}: "
                             "pass the policy's optimizer steps so far")
        cols["age"] = age
    if device is not None:
        cols = {k: v.to(device) if torch.is_tensor(v) else v for k, v in cols.items()}
    return cols


def padded_tokens(rollouts: list[Rollout], pad_id: int) -> dict[str, torch.Tensor]:
    """collate's token tensors: input_ids, attention_mask, position_ids [batch, prompt_len +
    max_len], completion_mask and behaviour_logp [batch, max_len]."""
    prompt_lens = torch.tensor([len(rollout.prompt_ids) for rollout in rollouts])
    completion_lens = torch.tensor([len(rollout.completion_ids) for rollout in rollouts])
    prompt_len, max_len = int(prompt_lens.max()), int(completion_lens.max())
    # Masks of the cells that hold prompt and completion tokens. Boolean-mask assignment fills
    # cells in row-major order, so writing the concatenated tokens through a mask places every
    # rollout's tokens in its row: a per-rollout copy in a few vectorized ops.
    column = torch.arange(prompt_len + max_len)
    prompt_cells = (column >= prompt_len - prompt_lens[:, None]) & (column < prompt_len)
    completion_cells = (column >= prompt_len) & (column < prompt_len + completion_lens[:, None])
    input_ids = torch.full((len(rollouts), prompt_len + max_len), pad_id, dtype=torch.long)
    input_ids[prompt_cells] = torch.cat([rollout.prompt_ids for rollout in rollouts])
    input_ids[completion_cells] = torch.cat([rollout.completion_ids for rollout in rollouts])
    attention_mask = (prompt_cells | completion_cells).long()
    completion_mask = completion_cells[:, prompt_len:]
    behaviour_logp = torch.zeros((len(rollouts), max_len))
    behaviour_logp[completion_mask] = torch.cat([rollout.behaviour_logp for rollout in rollouts])
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            # real tokens, as generate
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "completion_mask": completion_mask.float(), "behaviour_logp": behaviour_logp}
