"""minimal.py, the textbook: it imports nothing of the project, each of its pieces equals the module
it stands for on the same inputs (log mu, the advantages, collate, log pi_theta, the loss and its
gradient, the step), and it learns. The plain update_step equals the engineered one."""
import ast
import copy
import os
import re
import sys

import pytest
import torch

import buffer
import minimal
import replay_rl
import rollout
from infra import generation
from infra.engineered_update import update_step_engineered
from infra.policy import load_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# minimal.generate_rollouts' settings other than the model, tokenizer and prompts: the demo's
ARGS = dict(reward_fn=minimal.reward, num_generations=minimal.G, max_new_tokens=minimal.MAX_NEW_TOKENS,
            temperature=minimal.T, policy_version=0)


def test_minimal_imports_nothing_of_the_project():
    tree = ast.parse(open(os.path.join(ROOT, "minimal.py")).read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert imported - set(sys.stdlib_module_names) <= {"torch", "peft", "transformers"}, imported
    assert {"torch", "peft", "transformers"} <= imported


@pytest.fixture(scope="module")
def demo():
    """minimal.py's policy (the shipped demo folder, a LoRA adapter whose B is not zero) and its
    tokenizer, in eval mode; seeded."""
    torch.manual_seed(0)
    model, tokenizer = load_policy(minimal.MODEL, lora_r=8)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    return model.eval(), tokenizer


def end_ids_of(model, tokenizer) -> list[int]:
    """The ids that end a completion, which both collates take."""
    return rollout.end_token_ids(model, tokenizer)[0]


@pytest.fixture(scope="module")
def sampled(demo):
    """minimal.generate_rollouts' rollouts of 6 prompts (G = 8), converted to buffer.Rollout."""
    model, tokenizer = demo
    torch.manual_seed(1)
    mine, _ = minimal.generate_rollouts(model, tokenizer, minimal.TRAIN_PROMPTS[:6], **ARGS)
    theirs = [buffer.Rollout(prompt_ids=r.prompt_ids, completion_ids=r.completion_ids,
                             behaviour_logp=r.behaviour_logp, reward=r.reward,
                             advantage=r.advantage, policy_version=0,
                             baseline=0.0, temperature=minimal.T) for r in mine]     # tis: unread
    return mine, theirs


def test_log_mu_by_the_second_forward_is_log_pi_theta_of_the_module(demo, sampled):
    """minimal's log mu (a no-grad forward after generate) equals replay_rl.completion_logp on
    buffer.collate of the same rollouts: rho = 1 on fresh data, the completions' EOS included."""
    model, tokenizer = demo
    mine, theirs = sampled
    assert len({len(r.completion_ids) for r in mine}) > 1           # unequal lengths: padding
    cols = buffer.collate(theirs, tokenizer.pad_token_id, eos_ids=end_ids_of(model, tokenizer))
    with torch.no_grad():
        logp, _ = replay_rl.completion_logp(model, cols, minimal.T)
    mask = cols["completion_mask"].bool()
    assert (logp[mask] - cols["behaviour_logp"][mask]).abs().max() < 1e-5
    ends = [r.completion_ids[-1].item() for r in mine]
    assert tokenizer.eos_token_id in ends


def test_log_mu_equals_the_recorders_on_the_same_samples(demo, addition):
    """rollout.generate_rollouts records log mu while generate samples; minimal's second forward
    over those samples gives the same log-probs."""
    model, tokenizer = demo
    torch.manual_seed(2)
    recorded, _ = rollout.generate_rollouts(model, tokenizer, minimal.TRAIN_PROMPTS[:4],
                                            addition.reward, num_generations=4,
                                            max_new_tokens=minimal.MAX_NEW_TOKENS,
                                            policy_version=0, sampler=generation.recording_sampler())
    batch = minimal.collate([minimal.Rollout(r.prompt_ids, r.completion_ids, r.behaviour_logp,
                                             r.reward, r.advantage, 0, r.temperature)
                             for r in recorded],
                            tokenizer.pad_token_id, eos_ids=minimal.end_ids(model, tokenizer))
    with torch.no_grad():
        logp, _ = minimal.completion_logp(model, batch, minimal.T)
    mask = batch["completion_mask"].bool()
    assert (logp[mask] - batch["behaviour_logp"][mask]).abs().max() < 1e-5


def test_minimal_and_the_modules_share_names_fields_and_returns(demo, sampled):
    """A ninth reader: the same names meant other calls (G= against num_generations=, a tensor
    against (logp, entropy)), two acting-settings lists differed, and minimal's reward was a string
    match where train.py's parses an integer. Now the Rollouts have the same fields (but baseline,
    asymre's, which minimal.py has no use for: readers 13 and 14), completion_logp returns the module's (logp, entropy),
    generate_rollouts takes num_generations and returns a figures dict, the refused settings are
    the module's, and the reward is train.py's on the cases that differed."""
    import dataclasses
    import inspect
    import tasks
    model, tokenizer = demo
    mine, theirs = sampled
    names = lambda cls: [f.name for f in dataclasses.fields(cls)]
    assert names(minimal.Rollout) == [n for n in names(buffer.Rollout) if n != "baseline"]
    assert "num_generations" in inspect.signature(minimal.generate_rollouts).parameters
    _, figures = minimal.generate_rollouts(model, tokenizer, minimal.TRAIN_PROMPTS[:2], **ARGS)
    assert set(figures) == {"reward"} and 0 <= figures["reward"] <= 1
    eos_ids = end_ids_of(model, tokenizer)
    cols = buffer.collate(theirs, tokenizer.pad_token_id, eos_ids=eos_ids)
    with torch.no_grad():
        logp, entropy = minimal.completion_logp(
            model, minimal.collate(mine, tokenizer.pad_token_id, eos_ids=eos_ids), minimal.T)
        module_logp, module_entropy = replay_rl.completion_logp(model, cols, minimal.T)
    mask = cols["completion_mask"].bool()
    assert (entropy[mask] - module_entropy[mask]).abs().max() < 1e-4 and entropy[mask].min() > 0
    assert (logp[mask] - module_logp[mask]).abs().max() < 1e-5
    source = inspect.getsource(minimal.refuse_acting_settings)
    listed = set(re.findall(r'"(\w+)"', source.split("acting = ")[1].split("if getattr")[0]))
    assert listed == set(rollout.SET_TO_ACT)
    train_reward = tasks.addition_task().reward
    for completion in ("82", " 82 ", "082", "8 2", "82.", "-82", ""):
        assert minimal.reward("37+45=", completion) == train_reward("37+45=", completion), completion


def test_group_advantages_equal_the_modules_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    group = torch.arange(12) // 4
    mine = minimal.group_advantages(rewards, group)
    assert torch.equal(mine, rollout.group_advantages(rewards, group))
    # by hand: mean 0.5, sample std sqrt(1/3); an all-equal group gets exactly 0
    assert mine[0].item() == pytest.approx(0.5 / (3 ** -0.5 + 1e-4), rel=1e-6)
    assert mine[4:8].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert mine[11].item() == pytest.approx(0.75 / (0.5 + 1e-4), rel=1e-6)
    shuffled = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(minimal.group_advantages(rewards[shuffled], group[shuffled]),
                       mine[shuffled])                     # grouped by id, in any order


def test_collate_equals_the_modules(demo, sampled):
    model, tokenizer = demo
    mine, theirs = sampled
    eos_ids = minimal.end_ids(model, tokenizer)
    assert eos_ids == end_ids_of(model, tokenizer)                    # the same end ids
    a = minimal.collate(mine, tokenizer.pad_token_id, eos_ids=eos_ids)
    b = buffer.collate(theirs, tokenizer.pad_token_id, eos_ids=eos_ids)
    for key in ("input_ids", "attention_mask", "position_ids", "completion_mask",
                "behaviour_logp", "advantage"):
        assert torch.equal(a[key], b[key].to(a[key].dtype)), key


def stale(logp: torch.Tensor, seed: int) -> torch.Tensor:
    """log mu moved off log pi on every other row, so that weights differ from 1 and some are cut."""
    g = torch.Generator().manual_seed(seed)
    shift = torch.rand(logp.shape, generator=g) * 1.5 - 0.5
    shift[1::2] = 0
    return logp.detach() - shift


def test_the_loss_and_its_gradient_equal_the_modules(demo, sampled):
    """minimal.policy_loss and replay_rl.policy_loss (tis, C = 2, token_mean) on the same stale
    batch: the same value, the same gradient with respect to log pi_theta, weights cut at C."""
    model, tokenizer = demo
    _, theirs = sampled
    cols = buffer.collate(theirs, tokenizer.pad_token_id, eos_ids=end_ids_of(model, tokenizer))
    with torch.no_grad():
        logp, _ = replay_rl.completion_logp(model, cols, minimal.T)
    mu = stale(logp, 0)
    a_in, b_in = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    a, metrics = minimal.policy_loss(a_in, mu, cols["advantage"], cols["completion_mask"],
                                     is_cap=minimal.C)
    b, theirs_metrics = replay_rl.policy_loss(b_in, mu, cols["advantage"], cols["completion_mask"],
                                              is_cap=minimal.C)
    a.backward()
    b.backward()
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert torch.allclose(a_in.grad, b_in.grad, rtol=1e-6, atol=1e-9) and a_in.grad.abs().max() > 0
    assert metrics["is_truncated_frac"] == pytest.approx(theirs_metrics["is_truncated_frac"].item())
    assert metrics["is_truncated_frac"] > 0


def test_the_loss_by_hand():
    """Two tokens of one rollout, A = 2: rho = 3 cut to C = 2, rho = 0.5 kept;
    L = -(2 * 2 * log pi_1 + 0.5 * 2 * log pi_2) / 2, and the padding cell (NaN) counts not."""
    logp = torch.tensor([[-0.5, -1.0, float("nan")]], requires_grad=True)
    mu = torch.tensor([[-0.5 - torch.log(torch.tensor(3.0)).item(), -1.0 + 0.6931471805599453, 0]])
    loss, m = minimal.policy_loss(logp, mu, torch.tensor([2.0]), torch.tensor([[1.0, 1.0, 0.0]]),
                                  is_cap=2.0)
    assert loss.item() == pytest.approx(-(4 * -0.5 + 1 * -1.0) / 2, rel=1e-6)
    loss.backward()
    assert logp.grad[0, :2].tolist() == pytest.approx([-2.0, -0.5], rel=1e-6)
    assert logp.grad[0, 2].item() == 0.0
    assert m["is_truncated_frac"] == 0.5


def both_steps(model, tokenizer, mine, theirs, max_grad_norm, step=None):
    """One SGD step of minimal.update and one of replay_rl.update_step (what train.py runs) from
    the same weights on the same batch: (each one's metrics, the largest difference of the trained
    weights after the two steps, the largest move of one step)."""
    ours, other = copy.deepcopy(model), copy.deepcopy(model)
    sgd = lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)  # noqa
    eos_ids = end_ids_of(model, tokenizer)
    a = minimal.update(ours, sgd(ours), mine, tokenizer.pad_token_id, minimal.T, minimal.C,
                       eos_ids=eos_ids)
    b = (step or replay_rl.update_step)(other, sgd(other), theirs, pad_id=tokenizer.pad_token_id,
                                        eos_ids=eos_ids, current_version=0,
                                        max_grad_norm=max_grad_norm,
                                        temperature=minimal.T, is_cap=minimal.C)
    trained = [(x, y, z) for x, y, z in zip(ours.parameters(), other.parameters(),
                                            model.parameters()) if x.requires_grad]
    return (a, b, max((x - y).abs().max().item() for x, y, _ in trained),
            max((x - z).abs().max().item() for x, _, z in trained))


@pytest.fixture(scope="module")
def stale_batches(demo, sampled):
    """The sampled rollouts with log mu moved off (every other rollout), as both records."""
    mine, theirs = copy.deepcopy(sampled)
    g = torch.Generator().manual_seed(3)
    for i in range(0, len(mine), 2):
        shift = torch.rand(len(mine[i].behaviour_logp), generator=g)
        mine[i].behaviour_logp = mine[i].behaviour_logp - shift
        theirs[i].behaviour_logp = theirs[i].behaviour_logp - shift
    assert any(r.advantage != 0 for r in mine)
    return mine, theirs


def test_minimal_update_is_the_modules_update_step(demo, stale_batches):
    """The same loss and the same step (at the clip of 1, as both use): equal weights after one
    SGD step mean equal clipped gradients."""
    model, tokenizer = demo
    a, b, diff, moved = both_steps(model, tokenizer, *stale_batches, max_grad_norm=1.0)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["is_truncated_frac"] == pytest.approx(b["is_truncated_frac"])
    assert diff < 1e-6 and moved > 1e-4


def test_the_comparison_sees_a_gradient_off_by_a_constant_factor(demo, stale_batches, monkeypatch):
    """A 0.5x gradient with the same loss value, below the clip: the weights after the step differ."""
    model, tokenizer = demo
    real = minimal.policy_loss

    def halved(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss - 0.5 * (loss - loss.detach()), metrics       # the same value, 0.5x gradient
    monkeypatch.setattr(minimal, "policy_loss", halved)
    a, b, diff, _ = both_steps(model, tokenizer, *stale_batches, max_grad_norm=1.0)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert diff > 1e-5


def test_the_fifo_buffer_evicts_the_oldest_and_counts_uses():
    buf = minimal.ReplayBuffer(3, seed=0)
    made = [minimal.Rollout(torch.tensor([1]), torch.tensor([2]), torch.tensor([-0.1]), 1.0, 0.5, v,
                            1.0) for v in range(5)]
    buf.add(made[:2])
    buf.add(made[2:])
    assert [r.policy_version for r in buf.items] == [2, 3, 4]         # 0 and 1 left first
    batch = buf.sample(3)
    assert sorted(r.policy_version for r in batch) == [2, 3, 4]       # distinct within a batch
    assert all(r.uses == 1 for r in buf.items)
    buf.sample(2)
    assert sum(r.uses for r in buf.items) == 5                        # they stay: drawn again


def test_minimal_learns():
    """The demo model from 0.346 on the held-out sums to at least 0.85 in 20 rounds."""
    accuracy = minimal.main(rounds=20, eval_every=20, eval_prompts=200, log=lambda *a: None)
    print(f"minimal.py: {accuracy[0]:.3f} -> {accuracy[-1]:.3f}")
    assert accuracy[0] < 0.45 and accuracy[-1] >= 0.85, accuracy


@pytest.mark.parametrize("loss_type, normalization, beta", [("tis", "token_mean", 0.0),
                                                             ("ppo", "sequence_mean", 0.0),
                                                             ("tis", "token_mean", 0.5)])
def test_the_plain_update_is_the_engineered_one_in_micro_batches(demo, stale_batches, loss_type,
                                                                  normalization, beta):
    """replay_rl.update_step (one forward, the form a reader reads, what train.py runs) and
    update_step_engineered in micro-batches of 5 (the loss scaled by each one's share of the
    tokens, or of the sequences) take the same step, with the same figures: ppo's clipped count,
    the KL term with beta > 0."""
    model, tokenizer = demo
    rollouts = stale_batches[1]
    sgd = lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)  # noqa
    warm = dict(loss_type=loss_type, normalization=normalization, beta=beta, max_grad_norm=1e3,
                eos_ids=end_ids_of(model, tokenizer))
    model = copy.deepcopy(model)
    if beta:            # one step first moves the adapter off the base, so that the KL term is not 0
        replay_rl.update_step(model, sgd(model), rollouts, pad_id=tokenizer.pad_token_id,
                              current_version=3, **warm)
    plain, engineered = copy.deepcopy(model), copy.deepcopy(model)
    a = replay_rl.update_step(plain, sgd(plain), rollouts, pad_id=tokenizer.pad_token_id,
                              current_version=3, **warm)
    b = update_step_engineered(engineered, sgd(engineered), rollouts, pad_id=tokenizer.pad_token_id,
                               current_version=3, micro_batch_size=5, **warm)
    names = ["loss", "is_ratio_mean", "is_ratio_max", "is_truncated_frac", "approx_kl", "grad_norm"]
    for name in names + (["ref_kl"] if beta else []):
        assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-7), name
    assert a["age_mean"] == b["age_mean"] == 3
    assert not beta or a["ref_kl"] > 1e-6
    trained = [(p, q, r) for p, q, r in zip(plain.parameters(), engineered.parameters(),
                                            model.parameters()) if p.requires_grad]
    moved = max((p - r).abs().max().item() for p, _, r in trained)
    assert moved > 1e-3                                                        # a step at all
    # the same step up to float32 rounding of sums over many tokens (a wrong normalization of a
    # micro-batch would be off by a share of the step itself)
    assert max((p - q).abs().max().item() for p, q, _ in trained) < 5e-6 * max(1.0, moved)


def test_minimal_s_guards_the_second_reader_found_missing(demo, sampled, monkeypatch):
    """A second reader's traps in minimal.py's pieces: a model that ships a repetition penalty in
    its generation_config had it applied by generate while log mu ignored it (now every setting
    that changes the distribution is passed at its neutral value: the penalty never runs; one that
    acts whenever set is refused); a model in training mode with dropout trained on rho up to 3.8
    (now refused, in generate_rollouts and update alike); a round larger than N evicted its own
    first rollouts; an advantage of [batch, 1] broadcast; a padded prompt passed collate (now each
    refused)."""
    import transformers
    model, tokenizer = copy.deepcopy(demo[0]), demo[1]
    eos_ids = minimal.end_ids(model, tokenizer)
    calls = []
    real = transformers.RepetitionPenaltyLogitsProcessor.__call__
    monkeypatch.setattr(transformers.RepetitionPenaltyLogitsProcessor, "__call__",
                        lambda self, *a: calls.append(1) or real(self, *a))
    model.generation_config.repetition_penalty = 2.0
    minimal.generate_rollouts(model, tokenizer, minimal.TRAIN_PROMPTS[:2], **ARGS)
    assert calls == []
    calls.clear()
    warper = transformers.EpsilonLogitsWarper.__call__
    monkeypatch.setattr(transformers.EpsilonLogitsWarper, "__call__",
                        lambda self, *a: calls.append(1) or warper(self, *a))
    model.generation_config.epsilon_cutoff = 0.2        # a third reader's: overridden now
    minimal.generate_rollouts(model, tokenizer, minimal.TRAIN_PROMPTS[:2], **ARGS)
    assert calls == []
    model.generation_config.suppress_tokens = [5]
    with pytest.raises(ValueError, match=r"generation_config sets \['suppress_tokens'\]"):
        minimal.generate_rollouts(model, tokenizer, minimal.TRAIN_PROMPTS[:2], **ARGS)
    model.generation_config.suppress_tokens = None
    model.train()                   # the rates Llama passes to F.dropout itself act there too
    with pytest.raises(ValueError, match=r"training mode, where dropout may act: call model.eval"):
        minimal.generate_rollouts(model, tokenizer, minimal.TRAIN_PROMPTS[:2], **ARGS)
    with pytest.raises(ValueError, match="training mode"):
        minimal.completion_logp(model, minimal.collate(sampled[0][:2], tokenizer.pad_token_id,
                                                       eos_ids=eos_ids), minimal.T)
    with pytest.raises(ValueError, match="training mode"):
        minimal.update(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                              lr=0.0), sampled[0], tokenizer.pad_token_id,
                       minimal.T, minimal.C, eos_ids=eos_ids)
    model.eval()
    with pytest.raises(ValueError, match=r"advantage \[6, 1\]: one per rollout"):
        minimal.policy_loss(torch.zeros(6, 3), torch.zeros(6, 3), torch.zeros(6, 1),
                            torch.ones(6, 3), is_cap=2.0)
    padded = copy.copy(sampled[0][0])
    padded.prompt_ids = torch.cat([padded.prompt_ids, torch.tensor([tokenizer.pad_token_id])])
    with pytest.raises(ValueError, match="begins or ends with the pad id"):
        minimal.collate([padded], tokenizer.pad_token_id, eos_ids=eos_ids)
    untrimmed = copy.copy(sampled[0][0])
    untrimmed.completion_ids = torch.cat([untrimmed.completion_ids,
                                          torch.tensor([tokenizer.pad_token_id] * 2)])
    with pytest.raises(ValueError, match="ends with the pad id twice"):
        minimal.collate([untrimmed], tokenizer.pad_token_id, eos_ids=eos_ids)
    with pytest.raises(ValueError, match="17 rollouts added to a buffer of 16"):
        minimal.ReplayBuffer(16, seed=0).add(sampled[0][:17])


def test_minimal_samples_with_every_plain_setting_of_the_module(demo, monkeypatch):
    """A fourth reader: a model whose generation_config sets guidance_scale 3 made
    minimal.generate_rollouts sample from a guided mixture ('1' sampled 1.000 against a stored mu
    of 0.920), silently; the module passes guidance_scale=1. Now minimal's GenerationConfig holds
    every setting of rollout.PLAIN_SAMPLING at the module's value, so a model's own cannot fill one."""
    model, tokenizer = demo
    seen = []
    real = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: seen.append(kw["generation_config"])
                        or real(**kw))
    minimal.generate_rollouts(model, tokenizer, minimal.TRAIN_PROMPTS[:2], **ARGS)
    config = seen[0]
    assert {k: getattr(config, k) for k in rollout.PLAIN_SAMPLING} == rollout.PLAIN_SAMPLING


def test_minimal_scores_at_the_temperature_it_sampled_at_or_refuses(demo, sampled):
    """A fourth reader: minimal.completion_logp at T = 1 on rollouts sampled at T = 0.7 gave
    is_ratio_mean 1.0094 on fresh data, no error. Rollouts carry their T; it refuses another."""
    model, tokenizer = demo
    eos_ids = minimal.end_ids(model, tokenizer)
    cols = minimal.collate(sampled[0][:4], tokenizer.pad_token_id, eos_ids=eos_ids)
    assert cols["temperature"] == minimal.T
    with pytest.raises(ValueError, match=f"sampled at T = {minimal.T}, not 0.7"):
        minimal.completion_logp(model, cols, 0.7)
    mixed = [copy.copy(r) for r in sampled[0][:2]]
    mixed[1].temperature = 0.7
    with pytest.raises(ValueError, match="different temperatures"):
        minimal.collate(mixed, tokenizer.pad_token_id, eos_ids=eos_ids)


def test_a_completion_ends_at_any_end_id_the_model_lists(demo):
    """A chat model may end its turn with an id its generation_config lists beside the tokenizer's
    EOS (Llama-3's <|eot_id|>). minimal.py stopped only at the tokenizer's EOS and trained on what
    followed (an eighth reader: 4 of 12 completions ran past it). Here the digit '1' is listed as
    an end id: every completion ends at its first end id, as rollout.generate_rollouts' do."""
    model, tokenizer = demo
    one = tokenizer.convert_tokens_to_ids("1")
    listed = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, one]
    try:
        torch.manual_seed(3)
        mine, _ = minimal.generate_rollouts(model, tokenizer, minimal.TRAIN_PROMPTS[:4], **ARGS)
    finally:
        model.generation_config.eos_token_id = listed
    ends = torch.tensor([tokenizer.eos_token_id, one])
    assert not any(torch.isin(r.completion_ids[:-1], ends).any() for r in mine)
    assert any(r.completion_ids[-1] == one for r in mine)             # the listed id did end some
