import collections

import pytest
import torch

from buffer import (ReplayBuffer, ReplayBufferWithVariants, Rollout, buffer_state, collate,
                    load_buffer_state)


EOS = 99    # the end id collate takes: make's completions hold none (cut at max_new_tokens)


def make(i, version=0, prompt_len=2, completion_len=3):
    """A rollout whose tokens encode its id i, so order and identity are checkable."""
    return Rollout(prompt_ids=torch.full((prompt_len,), 100 + i), completion_ids=torch.arange(completion_len) + 10 * i,
                   behaviour_logp=-torch.arange(1, completion_len + 1) / (i + 1.0), reward=float(i % 2),
                   advantage=i - 0.5, policy_version=version, baseline=0.5, temperature=1.0)


def ids(rollouts):
    return [int(r.prompt_ids[0]) - 100 for r in rollouts]


def test_fifo_eviction_drops_oldest_first():
    buf = ReplayBuffer(capacity=3)
    buf.add([make(0), make(1)])
    buf.add([make(2), make(3), make(4)])
    assert ids(buf.items) == [2, 3, 4]
    buf.add([make(5)])
    assert ids(buf.items) == [3, 4, 5]


def test_sample_is_distinct_uniform_and_does_not_remove():
    buf = ReplayBuffer(capacity=10, seed=1)
    buf.add([make(i) for i in range(10)])
    counts = collections.Counter()
    for _ in range(2000):
        batch = buf.sample(4)
        assert len(set(ids(batch))) == 4                 # no duplicates inside a batch
        counts.update(ids(batch))
    assert len(buf) == 10                                # sampling leaves the buffer intact
    # each rollout is expected 2000*4/10 = 800 times; binomial sd ~ 22, so 700..900 is > 4 sd
    assert all(700 < counts[i] < 900 for i in range(10)), counts
    assert sorted(ids(buf.sample(10))) == list(range(10))
    with pytest.raises(ValueError):
        buf.sample(11)


def test_the_variants_all_off_are_the_plain_buffer():
    """train.py builds ReplayBufferWithVariants; with every variant off (its defaults) it keeps,
    evicts, draws and counts exactly as ReplayBuffer, the README's buffer, with the same seed."""
    plain, variants = ReplayBuffer(capacity=6, seed=5), ReplayBufferWithVariants(capacity=6, seed=5)
    drawn = {id(plain): [], id(variants): []}
    for start in range(0, 20, 4):
        for buf in (plain, variants):
            assert buf.add([make(i) for i in range(start, start + 4)]) == 4
            drawn[id(buf)].append(ids(buf.sample(3)))
    assert drawn[id(plain)] == drawn[id(variants)]
    assert ids(plain.items) == ids(variants.items) == list(range(14, 20))
    assert [r.uses for r in plain.items] == [r.uses for r in variants.items]
    assert plain.left_by_uses == variants.left_by_uses and sum(plain.left_by_uses) == 14


def test_use_counts_and_ages():
    buf = ReplayBufferWithVariants(capacity=4)
    buf.add([make(0, version=0), make(1, version=3)])
    batch = buf.sample(2)
    batch = buf.sample(2)
    assert [r.uses for r in buf.items] == [2, 2]
    cols = collate(sorted(batch, key=lambda r: r.policy_version), pad_id=0, current_version=5,
                   eos_ids=[EOS])
    assert cols["age"].tolist() == [5.0, 2.0]


def test_collate_gives_ages_only_for_a_given_policy_version_and_never_negative():
    """A default policy_version of 0 gave negative ages for rollouts of later policies: now the
    ages come only with the version, and a version older than a rollout's is refused."""
    rollouts = [make(0, version=3), make(1, version=4)]
    assert "age" not in collate(rollouts, pad_id=0, eos_ids=[EOS])
    cols = collate(rollouts, pad_id=0, current_version=4, eos_ids=[EOS])
    assert cols["age"].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="current_version 3"):
        collate(rollouts, pad_id=0, current_version=3, eos_ids=[EOS])


def test_max_age_drops_stale_rollouts():
    buf = ReplayBufferWithVariants(capacity=10, max_age=2)
    buf.add([make(0, version=0), make(1, version=1), make(2, version=3)])
    assert buf.drop_stale(current_version=3) == 1
    assert ids(buf.items) == [1, 2]                      # age 3 > 2 dropped; age 2 kept
    assert buf.drop_stale(current_version=10) == 2
    assert len(buf) == 0


def test_state_dict_round_trip_restores_items_and_sampling():
    buf = ReplayBuffer(capacity=5, seed=3)
    made = [make(i, version=i, prompt_len=1 + i % 3, completion_len=1 + i % 4) for i in range(7)]
    buf.add(made[:4])
    buf.add(made[4:])
    buf.sample(3)
    state = buffer_state(buf)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    other = ReplayBuffer(capacity=5, seed=99)
    load_buffer_state(other, state)
    for a, b in zip(buf.items, other.items):
        assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.behaviour_logp, b.behaviour_logp)
        assert (a.reward, a.advantage, a.policy_version, a.uses) == (b.reward, b.advantage, b.policy_version, b.uses)
    assert ids(buf.sample(3)) == ids(other.sample(3))    # the sampler's RNG travels too


def test_collate_pads_prompts_left_and_completions_right():
    a = Rollout(torch.tensor([5, 6, 7]), torch.tensor([8, 1]), torch.tensor([-0.1, -0.2]), 1.0, 0.5, 0, 0.5, 1.0)
    b = Rollout(torch.tensor([9]), torch.tensor([3, 4, 1]), torch.tensor([-0.3, -0.4, -0.5]), 0.0, -0.5, 0, 0.5,
                1.0)
    cols = collate([a, b], pad_id=0, eos_ids=[1])     # both end with EOS 1
    assert cols["input_ids"].tolist() == [[5, 6, 7, 8, 1, 0], [0, 0, 9, 3, 4, 1]]
    assert cols["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert cols["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert cols["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert torch.allclose(cols["behaviour_logp"], torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]))
    assert cols["advantage"].tolist() == [0.5, -0.5]


def test_positive_bias_retention_keeps_fresh_plus_freshest_correct():
    buf = ReplayBufferWithVariants(capacity=10, keep_correct_frac=0.3, correct_reward=1.0)
    buf.add([make(i) for i in range(10)])        # make(i).reward = i % 2: odd ids are correct
    buf.add([make(10), make(11), make(12)])
    # freshest (1 - 0.3) * 10 = 7: ids 6..12; plus the freshest 3 correct among ids 0..5: 1, 3, 5
    assert ids(buf.items) == [1, 3, 5, 6, 7, 8, 9, 10, 11, 12]
    buf.add([make(13), make(14)])
    # fresh: 8..14; correct among the older 1, 3, 5, 6, 7: the freshest 3 are 3, 5, 7
    assert ids(buf.items) == [3, 5, 7, 8, 9, 10, 11, 12, 13, 14]


def test_positive_bias_retention_stays_full_when_correct_rollouts_are_few():
    buf = ReplayBufferWithVariants(capacity=10, keep_correct_frac=0.5, correct_reward=1.0)
    rollouts = [make(i) for i in range(10)]
    for r in rollouts:
        r.reward = float(r.prompt_ids[0] == 102)     # only id 2 is correct
    buf.add(rollouts)
    buf.add([make(10, version=1), make(11, version=1)])     # fresh: 7..11 (5 = (1 - 0.5) * 10)
    # 5 slots for older rollouts: the one correct (2), then the freshest others (6, 5, 4, 3): still full
    assert ids(buf.items) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def test_positive_bias_retention_never_evicts_a_fresh_rollout_unused():
    buf = ReplayBufferWithVariants(capacity=10, keep_correct_frac=0.5, correct_reward=1.0)
    buf.add([make(i) for i in range(10)])
    buf.add([make(i) for i in range(10, 18)])        # 8 new > (1 - 0.5) * 10: all 8 stay
    # 2 slots left: the freshest correct among 0..9: 7 and 9
    assert ids(buf.items) == [7, 9] + list(range(10, 18))


def test_sample_with_remove_uses_each_rollout_once():
    buf = ReplayBufferWithVariants(capacity=10, seed=3)
    buf.add([make(i) for i in range(7)])
    first = buf.sample(4, remove=True)
    assert len(buf) == 3 and not set(ids(first)) & set(ids(buf.items))
    second = buf.sample(3, remove=True)
    assert sorted(ids(first) + ids(second)) == list(range(7)) and len(buf) == 0


def test_max_uses_retires_a_rollout_at_its_cap_and_counts_it():
    """max_uses 2 on 3 rollouts drawn 2 at a time: each leaves after its second use, so however
    many batches are asked for, no rollout is used a third time; left_by_uses counts them at 2."""
    buf = ReplayBufferWithVariants(capacity=10, seed=1)
    buf.add([make(i) for i in range(3)])
    uses = {i: 0 for i in range(3)}
    while len(buf) >= 2:
        for r in buf.sample(2, max_uses=2):
            uses[ids([r])[0]] += 1
    assert max(uses.values()) == 2 and all(r.uses < 2 for r in buf.items)
    assert buf.left_by_uses[2] == sum(n == 2 for n in uses.values()) >= 2
    with pytest.raises(ValueError, match="max_uses 0"):
        buf.sample(1, max_uses=0)


def test_skip_zero_advantage_stores_only_informative_rollouts():
    buf = ReplayBufferWithVariants(capacity=10, skip_zero_advantage=True, loss_type="tis")
    rollouts = [make(i) for i in range(4)]
    rollouts[2].advantage = 0.0
    buf.add(rollouts)
    assert ids(buf.items) == [0, 1, 3]


def test_rollouts_keep_their_sampling_temperature_through_a_checkpoint():
    """collate gives the batch's T (the loss checks it); a batch of two temperatures raises; the
    temperature survives state_dict, and a buffer saved before rollouts kept it takes the run's,
    which it must be given."""
    import dataclasses
    cool = [dataclasses.replace(make(i), temperature=0.7) for i in range(3)]
    assert collate(cool, pad_id=0, eos_ids=[EOS])["temperature"] == 0.7
    with pytest.raises(ValueError, match=r"temperatures \[0.7, 1.0\] in one batch"):
        collate(cool + [make(3)], pad_id=0, eos_ids=[EOS])
    buf = ReplayBuffer(capacity=4)
    buf.add(cool)
    state = buffer_state(buf)
    again = ReplayBuffer(capacity=4)
    load_buffer_state(again, state)
    assert [r.temperature for r in again.items] == [0.7] * 3
    old = {k: v for k, v in state.items() if k != "temperature"}
    load_buffer_state(again, old, temperature=0.5)
    assert [r.temperature for r in again.items] == [0.5] * 3
    with pytest.raises(ValueError, match="saved before rollouts kept their temperature"):
        load_buffer_state(again, old)


def test_every_rollout_that_leaves_is_counted_once_by_its_uses():
    """left_by_uses counts the rollouts evicted (FIFO and positive-bias), dropped as stale and
    taken with remove, each once, by the uses it had: with the ones still held, every stored one."""
    buf = ReplayBufferWithVariants(capacity=10, keep_correct_frac=0.3, max_age=2, seed=0,
                                   correct_reward=1.0)   # the draw below
    buf.add([make(i) for i in range(10)])
    buf.sample(4, current_version=0)                       # 4 of ids 0..9 used once
    used = set(ids(r for r in buf.items if r.uses))
    buf.add([make(10), make(11), make(12)])               # evicts ids 0, 2, 4 (see above)
    assert sum(buf.left_by_uses) == 3 and buf.left_by_uses[1:2] == [len(used & {0, 2, 4})]
    buf.add([make(13, version=5)])
    assert buf.drop_stale(current_version=5) == 9          # all but id 13: older than 2 steps
    buf.sample(1, remove=True, current_version=5)
    assert sum(buf.left_by_uses) == 14 - len(buf) == 14 and len(buf) == 0
    assert buf.left_by_uses == [13 - len(used), len(used) + 1]


def test_the_buffer_refuses_what_it_cannot_honour():
    """Called bare: more new rollouts at once than it holds (the first would leave unused), and the
    zero-advantage filter without a loss for which it is right (tis or ppo, beta 0)."""
    buf = ReplayBufferWithVariants(capacity=3)
    with pytest.raises(ValueError, match="4 rollouts added to a buffer of 3: the first 1 would be evicted"):
        buf.add([make(i) for i in range(4)])
    assert len(buf) == 0
    assert buf.add([make(i) for i in range(4)], limit=3) == 3          # what it stores fits
    for kw in (dict(), dict(loss_type="asymre"), dict(loss_type="tis", beta=0.1)):
        with pytest.raises(ValueError, match="the filter is only for tis or ppo without KL"):
            ReplayBufferWithVariants(capacity=3, skip_zero_advantage=True, **kw)
    assert ReplayBufferWithVariants(capacity=3, skip_zero_advantage=True, loss_type="ppo").skip_zero_advantage


def test_max_age_zero_is_refused_not_a_buffer_that_empties_after_every_step():
    """train.py's --max-age 0 means no limit (it passes None); the class given 0 itself would keep
    a rollout for one step only. A copier who wires a flag straight in gets one line instead."""
    with pytest.raises(ValueError, match="None is no limit"):
        ReplayBufferWithVariants(capacity=4, max_age=0)
