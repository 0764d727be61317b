import copy
import dataclasses

import pytest
import torch

import minimal
from replay_rl import load_policy, update_step
from infra.engineered_update import update_step_engineered
from rollout import generate_rollouts


@pytest.fixture(scope="module")
def stale_batch(tiny_path, addition):
    """(model, tokenizer, rollouts): a batch of stale data, behaviour log-probs off, so importance
    weights differ from 1 and some are cut."""
    torch.manual_seed(0)
    model, tokenizer = load_policy(tiny_path, lora_r=16)
    rollouts, _ = generate_rollouts(model, tokenizer, addition.train_prompts[:8], addition.reward,
                                    num_generations=8, max_new_tokens=addition.max_new_tokens, policy_version=0)
    g = torch.Generator().manual_seed(1)
    for r in rollouts[::2]:
        r.behaviour_logp = r.behaviour_logp - torch.rand(len(r.behaviour_logp), generator=g)
    assert any(r.advantage != 0 for r in rollouts)
    return model, tokenizer, rollouts


def both_steps(model, tokenizer, rollouts, max_grad_norm):
    """One SGD step of minimal.update and one of engineered_update.update_step_engineered (what train.py calls, with
    train.py's defaults) from the same weights on the same batch: (metrics of each, the largest
    difference of the trained weights after the two steps, the largest move of one step)."""
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    sgd = lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    mine = minimal.update(ours, sgd(ours), rollouts, tokenizer.pad_token_id, temperature=1.0, is_cap=2.0,
                          max_grad_norm=max_grad_norm)
    real = update_step_engineered(theirs, sgd(theirs), rollouts, pad_id=tokenizer.pad_token_id, policy_version=0,
                                  max_grad_norm=max_grad_norm)
    trained = [(a, b, c) for a, b, c in zip(ours.parameters(), theirs.parameters(), model.parameters())
               if a.requires_grad]
    return (mine, real, max((a - b).abs().max().item() for a, b, _ in trained),
            max((a - c).abs().max().item() for a, _, c in trained))


def test_minimal_update_is_train_pys_update(stale_batch):
    """The same loss and the same gradient, its scale included. SGD's step is -lr * gradient: below
    the clip, equal weights after it mean equal gradients. (At the clip of 1.0 this batch's norm is
    over it, both gradients are rescaled to norm 1, and only their direction would be compared.)"""
    mine, real, diff, moved = both_steps(*stale_batch, max_grad_norm=1e3)
    assert 1.0 < real["grad_norm"] < 1e3                    # over the default clip, under this one
    assert mine["loss"] == pytest.approx(real["loss"], rel=1e-5, abs=1e-7)
    assert mine["is_truncated_frac"] == pytest.approx(real["is_truncated_frac"]) and mine["is_truncated_frac"] > 0
    assert diff < 1e-6 and moved > 1e-3                     # the same step, and a step at all
    mine, real, diff, moved = both_steps(*stale_batch, max_grad_norm=1.0)     # train.py's default: clipped
    assert diff < 1e-6 and moved > 1e-4


def test_the_comparison_sees_a_gradient_off_by_a_constant_factor(stale_batch, monkeypatch):
    """An 8x gradient with the same loss value (the old comparison, under the clip, passed it)."""
    policy_loss = minimal.policy_loss

    def eightfold(*args, **kwargs):
        loss, metrics = policy_loss(*args, **kwargs)
        return loss + 7 * (loss - loss.detach()), metrics          # the same value, 8x the gradient

    monkeypatch.setattr(minimal, "policy_loss", eightfold)
    mine, real, diff, moved = both_steps(*stale_batch, max_grad_norm=1e3)
    assert mine["loss"] == pytest.approx(real["loss"], rel=1e-5)
    assert diff > 1e-3


def test_minimal_starts_alike_from_a_cold_cache_and_a_warm_one(tmp_path, monkeypatch):
    """Building the demo model on first use draws random numbers (a new model's initialization,
    before the shipped weights go in). minimal.main seeded before it: a run from an empty cache got
    other LoRA weights than the next one."""
    class Loaded(Exception):
        pass
    adapters = []

    def load(path, **kwargs):
        model, _ = load_policy(path, **kwargs)
        adapters.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        raise Loaded
    monkeypatch.setattr(minimal, "load_policy", load)
    for cache in ("a", "b", "a"):                       # cold, cold, warm
        monkeypatch.setenv("REPLAY_RL_CACHE", str(tmp_path / cache))
        with pytest.raises(Loaded):
            minimal.main()
    assert all(torch.equal(adapters[0][n], other[n]) for other in adapters[1:] for n in adapters[0])


def test_minimal_learns(tiny_path):
    accuracy = minimal.main(rounds=15, eval_every=15, eval_prompts=200, log=lambda *a: None)
    print(f"minimal.py: {accuracy[0]:.3f} -> {accuracy[-1]:.3f}")
    assert accuracy[-1] - accuracy[0] >= 0.3, accuracy     # measured +0.605 to +0.64 (seeds 0-2, one thread)


def test_a_batch_larger_than_the_buffer_is_refused_before_any_model(monkeypatch):
    """With B > N the buffer never holds a batch: minimal.py would generate forever and never train."""
    monkeypatch.setattr(minimal, "B", minimal.N + 1)
    monkeypatch.setattr(minimal, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=f"B = {minimal.N + 1} > N = {minimal.N}: the buffer never holds a batch"):
        minimal.main(rounds=1)


def test_a_round_larger_than_the_buffer_is_refused_before_any_model(monkeypatch):
    """With R > N part of each round is evicted before it is ever sampled: generated for nothing."""
    monkeypatch.setattr(minimal, "N", minimal.P * minimal.G - 1)
    monkeypatch.setattr(minimal, "B", minimal.N)
    monkeypatch.setattr(minimal, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=f"R = {minimal.P * minimal.G} > N = {minimal.N}: the oldest"):
        minimal.main(rounds=1)


@pytest.mark.parametrize("loss_type, normalization, beta", [("tis", "token_mean", 0.0),
                                                             ("ppo", "sequence_mean", 0.0),
                                                             ("tis", "token_mean", 0.5)])
def test_the_plain_update_is_the_engineered_one_in_micro_batches(stale_batch, loss_type, normalization, beta):
    """replay_rl.update_step (one forward, the form a reader reads) and update_step_engineered in
    micro-batches of 5 (the loss scaled by each one's share of the tokens, or of the sequences)
    take the same step, with the same figures: ppo's clipped count, the KL term with beta > 0."""
    model, tokenizer, rollouts = stale_batch
    sgd = lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    warm = dict(loss_type=loss_type, normalization=normalization, beta=beta, max_grad_norm=1e3)
    if beta:            # one step first moves the adapter off the base, so that the KL term is not 0
        model = copy.deepcopy(model)
        update_step(model, sgd(model), rollouts, pad_id=tokenizer.pad_token_id, policy_version=3, **warm)
    plain, engineered = copy.deepcopy(model), copy.deepcopy(model)
    a = update_step(plain, sgd(plain), rollouts, pad_id=tokenizer.pad_token_id, policy_version=3, **warm)
    b = update_step_engineered(engineered, sgd(engineered), rollouts, pad_id=tokenizer.pad_token_id,
                               policy_version=3, micro_batch_size=5, **warm)
    names = ["loss", "is_ratio_mean", "is_ratio_max", "is_truncated_frac", "approx_kl", "grad_norm"]
    for name in names + (["ref_kl"] if beta else []):
        assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-7), name
    assert a["age_mean"] == b["age_mean"] == 3 and a["is_truncated_frac"] > 0
    assert not beta or a["ref_kl"] > 1e-6
    trained = [(p, q, r) for p, q, r in zip(plain.parameters(), engineered.parameters(), model.parameters())
               if p.requires_grad]
    moved = max((p - r).abs().max().item() for p, _, r in trained)
    assert moved > 1e-3                                                        # a step at all
    # the same step up to float32 rounding (with beta the step is large: relative to it)
    assert max((p - q).abs().max().item() for p, q, _ in trained) < 1e-6 * max(1.0, moved)


def test_the_loss_takes_log_pi_at_the_temperature_generation_sampled_at(stale_batch, monkeypatch):
    """mu was recorded at TEMPERATURE: main passes it to the update, whose log pi_theta is taken at
    it, or rho != 1 on fresh rollouts; update reads no global of its own."""
    model, tokenizer, rollouts = stale_batch
    seen = []
    real = minimal.completion_logp
    monkeypatch.setattr(minimal, "completion_logp", lambda m, cols, *a: seen.append(a) or real(m, cols, *a))
    monkeypatch.setattr(minimal, "TEMPERATURE", 5.0)        # not read by update: its argument is
    at_07 = [dataclasses.replace(rollout, temperature=0.7) for rollout in rollouts]
    frozen = lambda: torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    minimal.update(copy.deepcopy(model), frozen(), at_07, tokenizer.pad_token_id, temperature=0.7, is_cap=2.0)
    assert seen == [(0.7,)]
    # rollouts sampled at another temperature (generation's changed, the loss's not): one line
    with pytest.raises(ValueError, match="sampled at temperature 1 but log pi_theta is taken at 0.7"):
        minimal.update(copy.deepcopy(model), frozen(), rollouts, tokenizer.pad_token_id, temperature=0.7,
                       is_cap=2.0)
