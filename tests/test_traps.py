"""Issue 53's seven traps, each met by calling the bare function as a person who copies it would:
without load_policy, without train.py, with hand-built Rollouts. Each one failed silently before."""
import copy
import math

import pytest
from conftest import policy_with_an_adapter
import torch
from transformers import GenerationConfig

import minimal
from buffer import Rollout, collate
from replay_rl import completion_logp, load_policy, log_pi_coefficient, policy_loss, update_step
from rollout import BehaviourLogProbs, generate_rollouts


@pytest.fixture
def policy(tiny_path):
    """A fresh policy each test: the tests below change its generation_config or its weights."""
    return policy_with_an_adapter(tiny_path)


def largest_log_rho(model, tokenizer, rollouts, temperature=1.0):
    """max |log pi_theta(o_t) - log mu(o_t)| over fresh rollouts: 0 up to rounding when the stored
    log mu is the distribution that drew the tokens."""
    cols = collate(rollouts, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logp(model, cols, temperature)
    return ((logp - cols["behaviour_logp"]).abs() * cols["completion_mask"]).max().item()


def test_trap1_a_models_own_generation_config_does_not_reach_the_sampler(policy, addition):
    """A model loaded without load_policy keeps its checkpoint's generation defaults (Qwen-Instruct
    ships a repetition penalty, top_k, top_p, a temperature), and generate fills every field the
    caller leaves unset from them. Before: a penalty of 1.3 went into log mu (largest |log rho| on
    fresh rollouts 1.7, not 1e-6). generate_rollouts now passes every such field, so they do not
    act; one it cannot neutralise (a list of suppressed tokens) is refused in one line."""
    model, tokenizer = policy
    shipped = model.generation_config
    shipped.repetition_penalty, shipped.top_k, shipped.top_p, shipped.temperature = 1.3, 3, 0.5, 0.4
    shipped.no_repeat_ngram_size, shipped.min_new_tokens, shipped.typical_p = 2, 3, 0.5
    torch.manual_seed(1)
    rollouts, _ = generate_rollouts(model, tokenizer, ["12+34=", "5+67="] * 4, addition.reward,
                                    num_generations=4, max_new_tokens=5, temperature=1.0,
                                    policy_version=0)
    assert largest_log_rho(model, tokenizer, rollouts) < 1e-5
    shipped.suppress_tokens = [5]
    with pytest.raises(ValueError, match=r"'suppress_tokens': \[5\]"):
        generate_rollouts(model, tokenizer, ["12+34="], addition.reward, num_generations=2,
                          max_new_tokens=5, temperature=1.0, policy_version=0)


def test_trap2_the_recorder_refuses_a_generate_that_would_not_sample_what_it_records(policy):
    """BehaviourLogProbs with a plain generate: transformers' top-k of 50 when top_k is unset, or
    the caller's own top_k, cut the distribution after the recorder has read the full softmax, and
    rho on fresh data stays 1, so no metric shows it. The recorder now reads the generation config
    generate is given, with the model's, and refuses it in one line; with top_k=0 it records the
    log-probs of the tokens drawn."""
    model, tokenizer = policy
    for top_k, said in [(None, "'top_k': 50"), (5, "'top_k': 5")]:
        config = GenerationConfig(do_sample=True, temperature=1.0, top_k=top_k, max_new_tokens=4)
        with pytest.raises(ValueError, match=said):
            BehaviourLogProbs(model, config)
    config = GenerationConfig(do_sample=True, temperature=0.8, top_k=0, max_new_tokens=4,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    recorder = BehaviourLogProbs(model, config)
    enc = tokenizer(["12+34=", "56+78="], return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(2)
    out = model.generate(**enc, generation_config=config, logits_processor=[recorder])
    completions = out[:, enc.input_ids.shape[1]:]
    mu, _ = recorder.finish(completions)
    with torch.no_grad():
        logits = model(out).logits[:, enc.input_ids.shape[1] - 1:-1].float()
    pi = torch.log_softmax(logits / 0.8, -1).gather(-1, completions[..., None]).squeeze(-1)
    assert (pi - mu)[:, 0].abs().max() < 1e-5       # the first token: no padding before it


def test_trap3_top_p_below_1_is_refused(policy, addition):
    """The stored log mu is the full softmax(z / T); a nucleus cut (top_p < 1) draws from another
    distribution (0.13 nats apart on average at top_p = 0.5) while rho on fresh data stays 1.
    Refused in one line, before any generation, by the function that samples."""
    model, tokenizer = policy
    with pytest.raises(ValueError, match="top_p 0.5 < 1: the stored log mu would ignore"):
        generate_rollouts(model, tokenizer, ["12+34="], addition.reward, num_generations=2,
                          max_new_tokens=5, temperature=1.0, top_p=0.5, policy_version=0)
    with pytest.raises(ValueError, match="top_p 0.9 < 1"):
        BehaviourLogProbs(model, GenerationConfig(do_sample=True, top_k=0, top_p=0.9))


def hand_built(reward, **fields):
    """A Rollout built by hand, as a reader who has their own sampler would."""
    return Rollout(prompt_ids=torch.tensor([3, 4]), completion_ids=torch.tensor([5, 1]),
                   behaviour_logp=torch.tensor([-0.5, -0.7]), reward=reward, advantage=0.0,
                   policy_version=0, **fields)


def test_trap4_a_rollout_has_no_silent_baseline():
    """AsymRE weighs log pi by r - (V - tau), V the baseline. A Rollout whose baseline defaulted
    to 0 passed the loss's guard: rewards 1 and 0 gave coefficients [1.1, 0.1], not [0.6, -0.4].
    Now a Rollout cannot be made without one."""
    with pytest.raises(TypeError, match="baseline"):
        hand_built(1.0, temperature=1.0)
    cols = collate([hand_built(1.0, baseline=0.5, temperature=1.0),
                    hand_built(0.0, baseline=0.5, temperature=1.0)], pad_id=0)
    coef = log_pi_coefficient(None, torch.zeros(2, 2), "asymre", cols["reward"], cols["baseline"],
                              asymre_tau=0.1)
    assert torch.allclose(coef.squeeze(1), torch.tensor([0.6, -0.4]))


def test_trap5_a_rollout_has_no_silent_temperature(policy):
    """The loss refuses a T other than the rollouts' own, but a Rollout whose temperature
    defaulted to 1.0 matched the loss's default of 1.0: a sampler at T = 0.7 passed, and the
    largest |log rho| on fresh data was 1.2. Now a Rollout cannot be made without its T, and one
    sampled at 0.7 meets the loss's default in one line."""
    model, _ = policy
    with pytest.raises(TypeError, match="temperature"):
        hand_built(1.0, baseline=0.5)
    cols = collate([hand_built(1.0, baseline=0.5, temperature=0.7)], pad_id=0)
    with pytest.raises(ValueError, match="sampled at temperature 0.7 but log pi_theta is taken at 1"):
        completion_logp(model, cols)


def test_trap6_the_plain_steps_skip_a_non_finite_step(policy, addition):
    """One NaN behaviour log-prob makes the loss NaN. update_step (the step the reading order
    names) and minimal.update took the step anyway and left NaN LoRA weights for good; now they
    skip it, as update_step_engineered does: the weights and AdamW's state stay as they were."""
    model, tokenizer = policy
    torch.manual_seed(3)
    rollouts, _ = generate_rollouts(model, tokenizer, ["12+34=", "5+67="], addition.reward,
                                    num_generations=4, max_new_tokens=5, temperature=1.5,
                                    policy_version=0)
    rollouts[0].behaviour_logp = rollouts[0].behaviour_logp.clone()
    rollouts[0].behaviour_logp[0] = math.nan
    rollouts[0].advantage = rollouts[1].advantage = 1.0       # a gradient, whatever the rewards
    steps = [lambda m, opt: update_step(m, opt, rollouts, pad_id=tokenizer.pad_token_id,
                                        policy_version=0, temperature=1.5),
             lambda m, opt: minimal.update(m, opt, rollouts, tokenizer.pad_token_id,
                                           temperature=1.5, is_cap=2.0)]
    for step in steps:
        trained = copy.deepcopy(model)
        params = [p for p in trained.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        metrics = step(trained, optimizer)
        assert all(torch.equal(p, q) for p, q in zip(params, before))     # before: all NaN
        assert metrics["skipped"] == 1 and not math.isfinite(metrics["loss"])
        assert optimizer.state == {} or all(not s for s in optimizer.state.values())


def test_trap7_micro_batch_losses_add_up_to_the_batch_loss_with_its_count():
    """token_mean divides by the batch's tokens: the mean of two micro-batches' losses is not the
    whole batch's (a row of 1 token and a row of 3 get equal say). policy_loss takes the whole
    batch's count, num_items_in_batch, and the micro-batches' losses then add up to the batch's,
    their gradients too; its docstring states the rule."""
    logp = torch.tensor([[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    mask, advantage = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]), torch.tensor([1.0, -1.0])
    for normalization, count in [("token_mean", 4), ("sequence_mean", 2)]:
        whole, _ = policy_loss(logp, logp.detach(), advantage, mask, normalization=normalization)
        (whole_grad,) = torch.autograd.grad(whole, logp)
        parts = [policy_loss(logp[i:i + 1], logp.detach()[i:i + 1], advantage[i:i + 1],
                             mask[i:i + 1], normalization=normalization,
                             num_items_in_batch=count)[0] for i in range(2)]
        (summed_grad,) = torch.autograd.grad(sum(parts), logp)
        assert sum(parts).item() == pytest.approx(whole.item())
        assert torch.allclose(summed_grad, whole_grad)
    naive = [policy_loss(logp[i:i + 1], logp.detach()[i:i + 1], advantage[i:i + 1],
                         mask[i:i + 1])[0] for i in range(2)]
    (naive_grad,) = torch.autograd.grad(sum(naive) / 2, logp)
    assert not torch.allclose(naive_grad, torch.autograd.grad(
        policy_loss(logp, logp.detach(), advantage, mask)[0], logp)[0])
    assert "num_items_in_batch" in policy_loss.__doc__ and "accumulat" in policy_loss.__doc__
