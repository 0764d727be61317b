import copy
import math

import pytest
from conftest import policy_with_an_adapter
import torch

from buffer import collate
from replay_rl import completion_logp
from infra.policy import load_policy
from rollout import end_token_ids, generate_rollouts, group_advantages
from infra.generation import recording_sampler


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 0.0, 1.0, 1.0])
    group = torch.arange(12) // 4                     # three prompts, their four completions each
    adv = group_advantages(rewards, group, std_floor=0.0)
    s = math.sqrt(1 / 3)                     # sample std of [1, 0, 0, 1]: sqrt((4 * 0.25) / 3)
    assert torch.allclose(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / s)
    assert torch.equal(group_advantages(rewards, group)[4:8], torch.zeros(4))   # all equal
    s2 = math.sqrt(2 / 3)                    # [2, 0, 1, 1]: mean 1, squares 1+1+0+0 over 3
    assert torch.allclose(adv[8:], torch.tensor([1.0, -1.0, 0.0, 0.0]) / s2)


def test_group_advantages_group_by_id_not_by_layout():
    # the same rewards listed sample-major (prompt 0, 1, 2, prompt 0, 1, 2, ...) with their ids:
    # each completion gets the A it gets in the prompt-major list
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 0.0, 1.0, 1.0])
    group = torch.arange(12) // 4
    order = torch.tensor([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11])
    assert torch.equal(group_advantages(rewards[order], group[order]),
                       group_advantages(rewards, group)[order])
    assert torch.equal(group_advantages(torch.tensor([3.0]), torch.tensor([7])),
                       torch.zeros(1))                             # a group of one: A = 0
    with pytest.raises(ValueError, match="one reward and one group id"):
        group_advantages(rewards.view(3, 4), group.view(3, 4))     # a [P, G] table: refused


@pytest.fixture(scope="module")
def policy(tiny_path):
    return policy_with_an_adapter(tiny_path)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logp_equals_training_forward(policy, addition, temperature):
    model, tokenizer = policy
    prompts = ["1+2=", "45+67=", "9+99=", "80+0="]          # different lengths: left padding in play
    torch.manual_seed(1)
    rollouts, stats = generate_rollouts(model, tokenizer, prompts, addition.reward, num_generations=4,
                                        max_new_tokens=5, temperature=temperature, policy_version=0)
    batch = collate(rollouts, tokenizer.pad_token_id, eos_ids=end_token_ids(model, tokenizer)[0])
    with torch.no_grad():
        logp, entropy = completion_logp(model, batch, temperature)
    mask = batch["completion_mask"]
    assert mask.sum() > len(rollouts)                          # real multi-token completions
    assert ((logp - batch["behaviour_logp"]).abs() * mask).max() < 1e-5
    assert stats["rollout_entropy"] == pytest.approx(((entropy * mask).sum() / mask.sum()).item(), abs=1e-5)
    # a different temperature is a different distribution: the check above can fail ...
    relabelled = {**batch, "temperature": temperature * 2}       # past the check, on purpose
    with torch.no_grad():
        other, _ = completion_logp(model, relabelled, temperature * 2)
    assert ((other - batch["behaviour_logp"]).abs() * mask).max() > 1e-2
    # ... so rollouts that record their T refuse a loss at another one, in one line
    assert batch["temperature"] == temperature
    with pytest.raises(ValueError, match=f"sampled at temperature {temperature:g} but log pi_theta is taken at"):
        completion_logp(model, batch, temperature * 2)


@pytest.mark.parametrize("shared_prefill", [False, True])
def test_log_mu_by_a_forward_after_generate_equals_the_recorders(policy, addition, shared_prefill):
    """generate_rollouts' method (no sampler: generate_completions, then forward_log_mu), minimal.py's
    way, samples the same completions (same seed) and gives the recorder's log mu and entropy
    (recording_sampler, with or without the shared prefill)."""
    model, tokenizer = policy
    prompts = ["1+2=", "45+67=", "9+99=", "80+0="]
    runs = {}
    for way in ("recorded", "forward"):
        torch.manual_seed(3)
        runs[way] = generate_rollouts(model, tokenizer, prompts, addition.reward, num_generations=4,
                                      max_new_tokens=5, temperature=0.7, policy_version=0,
                                      sampler=(recording_sampler(shared_prefill=shared_prefill)
                                               if way == "recorded" else None))
    (recorded, rec_stats), (forward, fwd_stats) = runs["recorded"], runs["forward"]
    assert sum(len(r.completion_ids) for r in recorded) > len(recorded)     # multi-token
    for a, b in zip(recorded, forward):
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert a.behaviour_logp.shape == b.behaviour_logp.shape
        assert (a.behaviour_logp - b.behaviour_logp).abs().max() < 1e-5
    assert (recorded[0].behaviour_logp != 0).any()                          # not the stand-ins' zeros
    assert fwd_stats["rollout_entropy"] == pytest.approx(rec_stats["rollout_entropy"], abs=1e-5)


def test_a_sampler_may_return_its_rows_in_any_order_with_their_group(policy, addition):
    """generate_rollouts reads which prompt each row answers from the sampler's group, not from the
    row's place (a reader's vLLM-like sampler returned its rows sample-major: every reward, A, V
    and prompt went to the wrong prompt). The same rows shuffled, with their group: the same
    rollouts, in the shuffled order. A group that does not give each prompt G rows: refused."""
    model, tokenizer = policy
    prompts = ["1+2=", "45+67=", "9+99="]

    def shuffled(order, group_of=None):
        def sampler(*args, **kwargs):
            ids, completions, group, eos_ids, log_mu, entropy = recording_sampler()(*args, **kwargs)
            return (ids, completions[order], (group_of if group_of is not None else group[order]),
                    eos_ids, log_mu[order], entropy[order])
        return sampler

    order = torch.tensor([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11])       # sample-major
    runs = []
    for sampler in (recording_sampler(), shuffled(order)):
        torch.manual_seed(5)
        runs.append(generate_rollouts(model, tokenizer, prompts, addition.reward, num_generations=4,
                                      max_new_tokens=5, temperature=1.0, policy_version=0,
                                      sampler=sampler)[0])
    plain, reordered = runs
    assert len({r.reward for r in plain}) > 1                  # rewards that differ: a real check
    for i, j in enumerate(order.tolist()):
        a, b = reordered[i], plain[j]
        assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.completion_ids,
                                                                         b.completion_ids)
        assert (a.reward, a.advantage, a.baseline) == (b.reward, b.advantage, b.baseline)
    with pytest.raises(ValueError, match="G = 4 rows for each of the 3 prompts"):
        generate_rollouts(model, tokenizer, prompts, addition.reward, num_generations=4,
                          max_new_tokens=5, temperature=1.0, policy_version=0,
                          sampler=shuffled(torch.arange(12), torch.zeros(12, dtype=torch.long)))


def test_completion_mask_includes_eos_and_excludes_padding(policy, addition):
    model, tokenizer = policy
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token                  # the common pad == eos setup
    eos = tokenizer.eos_token_id
    torch.manual_seed(2)
    # answers of 2 and 1 digits: completions of different lengths even when every answer is right
    rollouts, stats = generate_rollouts(model, tokenizer, ["12+34=", "1+2="] * 8, addition.reward,
                                        num_generations=4, max_new_tokens=4, temperature=1.5, policy_version=0)
    lengths = [len(r.completion_ids) for r in rollouts]
    ended = [r for r in rollouts if r.completion_ids[-1] == eos]
    assert ended and len(set(lengths)) > 1                     # some finished early: padding happened
    for r in rollouts:
        c = r.completion_ids.tolist()
        assert eos not in c[:-1]                               # cut at the first EOS ...
        assert c[-1] == eos or len(c) == 4                     # ... which is kept, unless truncated
        assert len(r.behaviour_logp) == len(c)
    batch = collate(rollouts, tokenizer.pad_token_id, eos_ids=end_token_ids(model, tokenizer)[0])
    assert batch["completion_mask"].sum(1).tolist() == lengths  # EOS counted, pads not
    assert stats["new_tokens"] == sum(lengths)
    # rewards follow the decoded completion, advantages are normalized per group of 4
    for i, r in enumerate(rollouts):
        text = tokenizer.decode(r.completion_ids, skip_special_tokens=True)
        assert r.reward == addition.reward(["12+34=", "1+2="][(i // 4) % 2], text)
    adv = torch.tensor([r.advantage for r in rollouts]).view(-1, 4)
    assert torch.allclose(adv.sum(1), torch.zeros(len(adv)), atol=1e-4)
    rewards = torch.tensor([r.reward for r in rollouts]).view(-1, 4)
    assert [r.baseline for r in rollouts] == rewards.mean(1).repeat_interleave(4).tolist()


def test_a_checkpoints_own_generation_settings_do_not_leak_into_sampling(tiny_path, addition, tmp_path):
    """Instruct checkpoints ship a repetition penalty, top_k, ... in generation_config.json; generate()
    would apply them unasked and the stored log-probs would no longer be those of the policy."""
    import shutil
    from transformers import GenerationConfig

    folder = tmp_path / "model"
    shutil.copytree(tiny_path, folder)
    shipped = GenerationConfig.from_pretrained(folder)
    shipped.do_sample, shipped.repetition_penalty, shipped.top_k, shipped.no_repeat_ngram_size = True, 1.3, 3, 2
    shipped.eos_token_id = [shipped.eos_token_id, 13]            # a second end token, as chat models have
    shipped.save_pretrained(folder)
    torch.manual_seed(0)
    model, tokenizer = load_policy(str(folder), lora_r=4)
    assert model.generation_config.repetition_penalty in (None, 1.0) and model.generation_config.eos_token_id == [1, 13]
    torch.manual_seed(3)
    rollouts, _ = generate_rollouts(model, tokenizer, ["11+11=", "22+33="] * 4, addition.reward,
                                    num_generations=4, max_new_tokens=5, policy_version=0)
    batch = collate(rollouts, tokenizer.pad_token_id, eos_ids=end_token_ids(model, tokenizer)[0])  # [1, 13]
    with torch.no_grad():
        logp, _ = completion_logp(model, batch)
    assert ((logp - batch["behaviour_logp"]).abs() * batch["completion_mask"]).max() < 5e-5     # rounding only (a penalty of 1.3: 0.26)
    for r in rollouts:                                         # token 13 ('+') ends a completion too
        ids = r.completion_ids.tolist()
        assert not ({1, 13} & set(ids[:-1]))


def test_fast_decoding_samples_what_plain_generate_samples(tiny_path):
    """--fast-generation: the same tokens and behaviour log-probs as plain generate under one seed,
    its static cache filled by the shared prefill (generation.prefill_once), with the decode step compiled (dynamo with the eager backend: the graph capture CUDA runs,
    without a compiler), after an update (the compiled step must see the new LoRA weights), and
    one cache kept across rounds of the same shape."""
    from transformers import CompileConfig

    from infra.engineered_update import update_step_engineered
    from infra.fast_decoding import FastDecoding

    torch.manual_seed(0)
    model, tokenizer = load_policy(tiny_path, lora_r=8)
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True          # compile on CPU too (transformers: CUDA only)
    fast = FastDecoding(model, compile_config)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    prompts, caches = ["1+2=", "45+67=", "9+99=", "80+0="], []
    for round_ in range(3):
        batch = prompts if round_ < 2 else prompts[:3]  # round 2: another batch size, a new cache
        pair = []
        for f in (None, fast):
            torch.manual_seed(10 + round_)
            # plain generate (G copies of each prompt) against the fast path on the shared prefill
            pair.append(generate_rollouts(model, tokenizer, batch, lambda p, c: float(len(c)), num_generations=4,
                                          max_new_tokens=5, temperature=1.5, policy_version=0,
                                          sampler=recording_sampler(fast=f, shared_prefill=f is not None))[0])
        caches.append(fast.caches[len(batch) * 4])
        plain, quick = pair
        assert [r.completion_ids.tolist() for r in plain] == [r.completion_ids.tolist() for r in quick]
        assert max((a.behaviour_logp - b.behaviour_logp).abs().max().item() for a, b in zip(plain, quick)) < 1e-5
        loss = update_step_engineered(model, optimizer, quick, pad_id=tokenizer.pad_token_id,
                                      eos_ids=end_token_ids(model, tokenizer)[0], current_version=round_,
                                      temperature=1.5)
        assert loss["grad_norm"] > 0                    # the policy moved: the next round samples anew
    assert caches[0] is caches[1] and caches[2] is not caches[1]
    assert sorted(fast.caches) == [12, 16] and fast.length == 64     # 3 or 4 prompts x 4; rounded up to 64


def test_behaviour_logprobs_by_hand_and_an_extra_step_dropped():
    """BehaviourLogProbs: the log-prob of each sampled token under the step's logits, gathered one call
    late; a decode step that generate runs past the returned tokens (MPS) does not shift or add any."""
    from infra.generation import BehaviourLogProbs

    torch.manual_seed(0)
    scores = torch.randn(4, 2, 6)                       # steps x batch x vocab
    tokens = torch.tensor([[1, 5], [0, 2], [3, 3]])     # the tokens sampled at steps 1..3
    prompt = torch.tensor([[7], [7]])
    expected = torch.stack([torch.log_softmax(scores[t] / 0.5, -1)[[0, 1], tokens[t]] for t in range(3)], 1)
    from types import SimpleNamespace

    from transformers import GenerationConfig
    model = SimpleNamespace(generation_config=GenerationConfig(), training=False,   # no layers
                            modules=lambda: [], named_modules=lambda: [])
    for extra_step in (False, True):
        rec = BehaviourLogProbs(model, GenerationConfig(do_sample=True, temperature=0.5, top_k=0))
        for t in range(4 if extra_step else 3):
            rec(torch.cat([prompt, tokens[:t].T], 1), scores[t])
        logp, entropy = rec.finish(tokens.T)
        assert torch.allclose(logp, expected) and entropy.shape == (2, 3)
        with pytest.raises(RuntimeError, match="make a new one for each generate call"):
            rec(torch.cat([prompt, tokens.T], 1), scores[0])           # single use, said so


def test_a_round_of_equal_rewards_says_so_once(policy, addition):
    """G = 1 gives every rollout A = 0 (no group to compare with): generate_rollouts, called bare,
    warns once, however many such rounds follow."""
    import warnings
    model, tokenizer = policy
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            rollouts, _ = generate_rollouts(model, tokenizer, ["1+2=", "3+4="], addition.reward,
                                            num_generations=1, max_new_tokens=4, policy_version=0)
            assert all(rollout.advantage == 0 for rollout in rollouts)
    said = [str(w.message) for w in caught if "equal rewards" in str(w.message)]
    assert said == ["every group of this round had equal rewards (G = 1): A = 0 for all, so tis and ppo "
                    "get no gradient from it (with G = 1, never)"]


def forward_shapes(model):
    """[input_ids shape of each forward of the base model], recorded from now on, and the hook."""
    shapes = []
    hook = model.get_base_model().register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    return shapes, hook


def test_each_prompt_is_prefilled_once_and_samples_what_plain_generate_samples(policy, addition):
    """generation.prefill_once: the prefix every prompt shares runs once (batch 1), each prompt's rest
    once (P rows, left-padded after the prefix), and only the last column runs for the P x G rows;
    the same completions as generate given G copies of each prompt, under one seed, and the same
    behaviour log-probs, which equal a teacher-forced forward within 1e-5 (rho = 1 on fresh data)."""
    model, tokenizer = policy
    prompts = ["12+3=", "12+45=", "12+9=", "12+67="]            # "12+" shared; 2 lengths: padding
    found = {}
    for shared in (False, True):
        shapes, hook = forward_shapes(model)
        torch.manual_seed(4)
        found[shared] = generate_rollouts(model, tokenizer, prompts, addition.reward, num_generations=4,
                                          max_new_tokens=5, temperature=1.3, policy_version=0,
                                          sampler=recording_sampler(shared_prefill=shared))[0]
        hook.remove()
        steps = max(len(r.completion_ids) for r in found[shared])
        # plain: 16 rows x 6 columns at once; shared: the prefix, the rests but their last column,
        # then that column for the 16 rows; then a decode step per further token, 16 rows each
        assert shapes == ([(16, 6)] if not shared else [(1, 3), (4, 2), (16, 1)]) + [(16, 1)] * (steps - 1)
    plain, shared = found[False], found[True]
    assert [r.completion_ids.tolist() for r in plain] == [r.completion_ids.tolist() for r in shared]
    assert max((a.behaviour_logp - b.behaviour_logp).abs().max().item() for a, b in zip(plain, shared)) < 1e-5
    batch = collate(shared, tokenizer.pad_token_id, eos_ids=end_token_ids(model, tokenizer)[0])
    with torch.no_grad():
        logp, _ = completion_logp(model, batch, 1.3)
    mask = batch["completion_mask"].bool()
    assert mask.sum() > len(shared)                              # real multi-token completions
    assert (torch.exp(logp - batch["behaviour_logp"])[mask] - 1).abs().max() < 1e-5


def test_one_prompt_is_prefilled_once_for_its_group_and_pad_may_be_eos(policy, addition):
    """P = 1: all but the last prompt token run as the shared prefix; with pad == eos the prefix's
    padding cannot be confused with an end token (the attention mask, not the ids, says which)."""
    model, tokenizer = policy
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    found = {}
    for shared in (False, True):
        shapes, hook = forward_shapes(model)
        torch.manual_seed(5)
        found[shared] = generate_rollouts(model, tokenizer, ["45+67="], addition.reward, num_generations=8,
                                          max_new_tokens=4, temperature=1.5, policy_version=0,
                                          sampler=recording_sampler(shared_prefill=shared))[0]
        hook.remove()
        assert shapes[:2] == ([(8, 6), (8, 1)] if not shared else [(1, 5), (8, 1)])
    assert [r.completion_ids.tolist() for r in found[False]] == [r.completion_ids.tolist() for r in found[True]]
    assert max((a.behaviour_logp - b.behaviour_logp).abs().max().item()
               for a, b in zip(found[False], found[True])) < 1e-5


def test_greedy_evals_on_a_shared_prefix_give_plain_generates_completions(policy):
    """greedy_rewards (train.py's eval): the prompts' shared first tokens run once, every prompt in
    one batch; the same greedy completions as plain generate."""
    from infra.generation import greedy_rewards

    model, tokenizer = policy
    prompts = [f"3{a}+{b}=" for a in range(10) for b in (1, 22, 333)]     # "3" shared; 3 lengths
    texts = {}
    for shared in (False, True):
        shapes, hook = forward_shapes(model)
        texts[shared] = []
        greedy_rewards(model, tokenizer, prompts, {"r": lambda p, c: texts[shared].append(c) or 0.0},
                       max_new_tokens=4, shared_prefill=shared, drop_ended=shared)
        hook.remove()
        assert shapes[:2] == ([(30, 7), (30, 1)] if not shared else [(1, 1), (30, 5)])
    assert texts[True] == texts[False] and len(set(texts[True])) > 3


def test_greedy_completions_drop_the_rows_that_ended_and_match_generate(policy):
    """generation.greedy_completions: a row that holds an end token leaves the batch (and the KV
    cache) at the next run of generate; the same completions as one generate call of all rows."""
    from transformers import GenerationConfig

    from rollout import end_token_ids
    from infra.generation import greedy_completions

    model, tokenizer = policy
    prompts = ["1+2=", "45+67=", "9+99=", "80+0=", "3+4=", "99+99="]       # replies of 1-3 digits
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    eos_ids, pad_id = end_token_ids(model, tokenizer)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=eos_ids, pad_token_id=pad_id)
    inputs = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}
    with torch.no_grad():
        whole = model.generate(**inputs, generation_config=config)[:, enc.input_ids.shape[1]:]
    shapes, hook = forward_shapes(model)
    with torch.no_grad():
        new = greedy_completions(model, inputs, {}, config, steps=1)
    hook.remove()
    lengths = [row.index(eos_ids[0]) + 1 for row in whole.tolist()]
    assert len(set(lengths)) > 1                                 # the rows end at different steps
    batch = [rows for rows, _ in shapes]
    assert batch == [sum(k > step for k in lengths) for step in range(max(lengths))]
    cut = lambda rows: [row[:row.index(eos_ids[0]) + 1] for row in rows]
    assert cut(new) == cut(whole.tolist())
