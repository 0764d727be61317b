"""Issue 53's seven traps and issue 61's twelve, each met by calling the bare function as a person
who copies it would: without load_policy, without train.py, with hand-built Rollouts. Each one
failed silently (or with an obscure error) before."""
import copy
import dataclasses
import math
import warnings

import pytest
from conftest import policy_with_an_adapter
import torch
from transformers import GenerationConfig

import minimal
from buffer import (ReplayBuffer, ReplayBufferWithVariants, Rollout, buffer_state, collate,
                    load_buffer_state)
import replay_rl
import rollout
from replay_rl import advantage_term, completion_logp, policy_loss, update_step
from rollout import PLAIN_SAMPLING, generate_rollouts
from infra import generation
from infra.generation import BehaviourLogProbs


@pytest.fixture
def policy(tiny_path):
    """A fresh policy each test: the tests below change its generation_config or its weights."""
    return policy_with_an_adapter(tiny_path)


def end_ids_of(model, tokenizer) -> list[int]:
    """The ids that end a completion, which collate takes (rollout.end_token_ids)."""
    return rollout.end_token_ids(model, tokenizer)[0]


def largest_log_rho(model, tokenizer, rollouts, temperature=1.0):
    """max |log pi_theta(o_t) - log mu(o_t)| over fresh rollouts: 0 up to rounding when the stored
    log mu is the distribution that drew the tokens."""
    cols = collate(rollouts, tokenizer.pad_token_id, eos_ids=end_ids_of(model, tokenizer))
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


def test_the_recorder_refuses_a_generate_that_decodes_greedily(policy):
    """The third reader's T4: a recorder made with a sampling config, generate called without that
    config. generate then decodes greedily (the demo's do_sample is unset): at T = 1 nothing
    objected, the G "samples" were identical and the recorded log mu was that of a softmax the
    tokens were not drawn from. The recorder refuses at its first call, in one line; with the
    config it records (the sampling path runs)."""
    model, tokenizer = policy
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=3,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    enc = tokenizer(["12+34="] * 4, return_tensors="pt", add_special_tokens=False)
    assert not model.generation_config.do_sample
    with pytest.raises(ValueError, match="decoding greedily"):
        model.generate(**enc, max_new_tokens=3, pad_token_id=tokenizer.pad_token_id,
                       logits_processor=[BehaviourLogProbs(model, config)])
    recorder = BehaviourLogProbs(model, config)
    out = model.generate(**enc, generation_config=config, logits_processor=[recorder])
    assert recorder.finish(out[:, enc.input_ids.shape[1]:])[0].shape == (4, out.shape[1] - 6)


def test_trap3_top_p_below_1_is_refused(policy, addition):
    """The stored log mu is the full softmax(z / T); a nucleus cut (top_p < 1) draws from another
    distribution (0.13 nats apart on average at top_p = 0.5) while rho on fresh data stays 1.
    generate_rollouts takes no top_p (it passes 1, overriding the model's own: trap 1); the
    recorder, copied alone, refuses one in the config it is given, in one line."""
    model, tokenizer = policy
    with pytest.raises(ValueError, match="top_p 0.5 < 1: the stored log mu would ignore"):
        BehaviourLogProbs(model, GenerationConfig(do_sample=True, top_k=0, top_p=0.5))
    with pytest.raises(ValueError, match="top_p 0.9 < 1"):
        BehaviourLogProbs(model, GenerationConfig(do_sample=True, top_k=0, top_p=0.9))


HAND_EOS = [1]      # the end id of hand_built's completion [5, 1]


def hand_built(reward, **fields):
    """A Rollout built by hand, as a reader who has their own sampler would."""
    return Rollout(prompt_ids=torch.tensor([3, 4]), completion_ids=torch.tensor([5, 1]),
                   behaviour_logp=torch.tensor([-0.5, -0.7]), reward=reward, advantage=0.0,
                   policy_version=0, **fields)


@pytest.mark.parametrize("fn", [rollout.group_advantages, minimal.group_advantages],
                         ids=["module", "minimal"])
def test_group_advantages_refuses_float_group_ids_and_a_nan_reward(fn):
    """Copied alone (reader 20): group ids of arange(n) / G (floats, not // G) made every
    completion a group of one, A = 0 for all; a NaN or inf reward gave its whole group A = NaN.
    Both refused, in one line; the right call gives the hand-computed A."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="integers"):
        fn(rewards, torch.arange(4) / 2)
    with pytest.raises(ValueError, match="finite"):
        fn(torch.tensor([1.0, float("nan"), 1.0, 1.0]), torch.arange(4) // 2)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)              # [1, 0]: mean 0.5, sample std sqrt(0.5)
    assert torch.allclose(fn(rewards, torch.arange(4) // 2), torch.tensor([a, -a, 0.0, 0.0]))


@pytest.mark.parametrize("loss_type", ["tis", "ppo", "asymre"])
def test_no_gradient_reaches_the_advantage_reward_or_baseline(loss_type):
    """Reader 21: policy_loss detached behaviour_logp but not A, r or V. An A that carried a graph
    (a critic's baseline, a differentiable reward model) was trained by the policy loss (a critic
    weight's gradient -0.245). Now no gradient reaches them; log pi_theta's is unchanged."""
    logp = torch.tensor([[-0.5, -1.0], [-0.2, -0.3]], requires_grad=True)
    critic = torch.tensor(0.3, requires_grad=True)
    reward = torch.tensor([1.0, 0.0])
    baseline = reward.mean() * critic / critic.detach()         # V = 0.5, with a graph to critic
    advantage = (reward - baseline) * 2.0
    loss, _ = policy_loss(logp, logp.detach() - 0.1, advantage, torch.ones(2, 2),
                          loss_type=loss_type, reward=reward, baseline=baseline)
    loss.backward()
    assert critic.grad is None or critic.grad == 0
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    if loss_type == "tis":
        minimal_logp = logp.detach().clone().requires_grad_(True)
        critic.grad = None
        minimal.policy_loss(minimal_logp, logp.detach() - 0.1, (reward - baseline) * 2.0,
                            torch.ones(2, 2), is_cap=2.0)[0].backward()
        assert critic.grad is None or critic.grad == 0
        assert torch.allclose(minimal_logp.grad, logp.grad)


def test_collate_refuses_an_empty_prompt_before_completion_logp_misreads_it():
    """A rollout with no prompt tokens: collate passed it, and completion_logp then refused
    collate's own columns ("build them with collate"). The first completion token has no position
    before it to be scored from: collate refuses it, naming why."""
    empty = dataclasses.replace(hand_built(1.0, baseline=0.5, temperature=1.0),
                                prompt_ids=torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="an empty prompt"):
        collate([empty], 0, eos_ids=[1])
    collate([hand_built(1.0, baseline=0.5, temperature=1.0)], 0, eos_ids=[1])   # the same, with one


def test_trap4_a_rollout_has_no_silent_baseline():
    """AsymRE weighs log pi by r - (V - tau), V the baseline. A Rollout whose baseline defaulted
    to 0 passed the loss's guard: rewards 1 and 0 gave coefficients [1.1, 0.1], not [0.6, -0.4].
    Now a Rollout cannot be made without one."""
    with pytest.raises(TypeError, match="baseline"):
        hand_built(1.0, temperature=1.0)
    cols = collate([hand_built(1.0, baseline=0.5, temperature=1.0),
                    hand_built(0.0, baseline=0.5, temperature=1.0)], pad_id=0,
                   eos_ids=HAND_EOS)
    coef = advantage_term(None, torch.zeros(2, 2), "asymre", cols["reward"], cols["baseline"],
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
    cols = collate([hand_built(1.0, baseline=0.5, temperature=0.7)], pad_id=0,
                   eos_ids=HAND_EOS)
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
    eos_ids = end_ids_of(model, tokenizer)
    steps = [lambda m, opt: update_step(m, opt, rollouts, pad_id=tokenizer.pad_token_id,
                                        eos_ids=eos_ids, current_version=0, temperature=1.5),
             lambda m, opt: minimal.update(m.eval(), opt, [
                 minimal.Rollout(r.prompt_ids, r.completion_ids, r.behaviour_logp, r.reward,
                                 r.advantage, 0, r.temperature) for r in rollouts],
                 tokenizer.pad_token_id,
                 1.5, 2.0, eos_ids=eos_ids)]
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


# ---- Issue 61's twelve traps: each in the function a person copies, called bare ----------------
def test_issue61_trap1_max_age_acts_at_sampling():
    """ReplayBufferWithVariants(max_age=1) kept ages 0 and 10 alike unless the caller ran drop_stale. Now
    sample needs the current policy_version when max_age is set, and drops the stale first."""
    buf = ReplayBufferWithVariants(4, max_age=1, seed=0)
    buf.add([hand_built(1.0, baseline=0.5, temperature=1.0) for _ in range(2)])
    buf.items[0].policy_version = 0
    buf.items[1].policy_version = 10
    with pytest.raises(ValueError, match="max_age 1: pass sample"):
        buf.sample(1)
    assert buf.sample(1, current_version=10)[0].policy_version == 10
    assert [r.policy_version for r in buf.items] == [10]


def test_issue61_trap2_a_rollout_is_equal_to_itself_only():
    """A default dataclass compared Rollouts field by field, tensors included: `in`, index and
    remove raised "Boolean value of Tensor ... is ambiguous". Equality is identity now."""
    a, b = hand_built(1.0, baseline=0.5, temperature=1.0), hand_built(1.0, baseline=0.5,
                                                                       temperature=1.0)
    batch = [a, b]
    assert b in batch and batch.index(b) == 1 and a != b
    batch.remove(a)
    assert batch == [b]


def test_issue61_trap3_correct_means_the_full_reward_not_above_zero():
    """Positive-bias retention ranked reward > 0 as correct: two older rollouts rewarded 0.1 were
    kept and the one rewarded 1.0 evicted. Correct is now reward >= correct_reward, which the
    buffer requires (a default of 1.0 made rewards on another scale silently FIFO)."""
    with pytest.raises(ValueError, match="keep_correct_frac needs correct_reward"):
        ReplayBufferWithVariants(4, keep_correct_frac=0.5)  # a default fit only a 0/1 reward
    buf = ReplayBufferWithVariants(4, keep_correct_frac=0.5, seed=0, correct_reward=1.0)
    right, *rest = [hand_built(r, baseline=0.5, temperature=1.0) for r in (1.0, 0.1, 0.1, 0.0)]
    buf.add([right, *rest])
    buf.add([hand_built(0.0, baseline=0.5, temperature=1.0) for _ in range(2)])
    assert right in buf.items and [r.reward for r in buf.items[:2]] == [1.0, 0.0]
    partial = ReplayBufferWithVariants(4, keep_correct_frac=0.5, seed=0, correct_reward=0.1)
    partial.add([hand_built(r, baseline=0.5, temperature=1.0) for r in (1.0, 0.1, 0.1, 0.0)])
    partial.add([hand_built(0.0, baseline=0.5, temperature=1.0) for _ in range(2)])
    assert [r.reward for r in partial.items[:2]] == [0.1, 0.1]


def test_issue61_trap4_two_unseeded_buffers_draw_differently():
    """seed defaulted to 0: two buffers drew the same indices ([4, 0, 7] from both). Unseeded
    ones now draw from fresh seeds; seeded ones still repeat."""
    def draw(**seed):
        buf = ReplayBuffer(100, **seed)
        buf.add([hand_built(float(i), baseline=0.5, temperature=1.0) for i in range(100)])
        return [r.reward for r in buf.sample(10)]
    assert draw() != draw()
    assert draw(seed=3) == draw(seed=3)


def test_issue61_trap5_sampling_with_active_dropout_is_refused(policy, addition):
    """A model with attention dropout 0.3 in training mode gave is_ratio_mean 0.872 on fresh data,
    silently: it sampled through dropout. generate_rollouts refuses it; in eval mode it samples."""
    model, tokenizer = policy
    attention = next(m for m in model.modules() if hasattr(m, "attention_dropout"))
    attention.attention_dropout = 0.3
    model.train()
    for sampler in (generation.recording_sampler(), None):     # with the recorder, and without it
        with pytest.raises(ValueError, match="training mode with active dropout .*: 0.3"):
            generate_rollouts(model, tokenizer, ["12+34="], addition.reward, num_generations=2,
                              max_new_tokens=3, temperature=1.0, policy_version=0, sampler=sampler)
    model.eval()
    rollouts, _ = generate_rollouts(model, tokenizer, ["12+34="], addition.reward,
                                    num_generations=2, max_new_tokens=3, temperature=1.0,
                                    policy_version=0)
    assert len(rollouts) == 2


def test_issue61_trap6_a_sampling_keyword_given_to_generate_is_refused(policy):
    """generate(temperature=0.5) with a recorder built for T = 1 recorded log mu at the wrong T,
    silently. The recorder now reads, at its first call, the processors generate runs beside it."""
    model, tokenizer = policy
    config = GenerationConfig(**PLAIN_SAMPLING, temperature=1.0, max_new_tokens=3,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    enc = tokenizer(["12+34="], return_tensors="pt", add_special_tokens=False)
    for keywords, said in [({"temperature": 0.5}, r"temperature \[0.5\]"),
                           ({"top_k": 5}, "TopKLogitsWarper")]:
        with pytest.raises(ValueError, match=said):
            model.generate(**enc, generation_config=config, **keywords,
                           logits_processor=[BehaviourLogProbs(model, config)])
    model.generate(**enc, generation_config=config, logits_processor=[BehaviourLogProbs(model,
                                                                                         config)])


def test_issue61_trap7_rollouts_hold_tensors_a_caller_can_modify(policy, addition):
    """Rollouts held inference tensors (made under torch.inference_mode): clamp_ raised."""
    model, tokenizer = policy
    rollouts, _ = generate_rollouts(model, tokenizer, ["12+34="], addition.reward,
                                    num_generations=2, max_new_tokens=3, temperature=1.0,
                                    policy_version=0)
    for r in rollouts:
        r.behaviour_logp.clamp_(min=-5.0)
        r.prompt_ids.add_(0)
        r.completion_ids.add_(0)
        assert not torch.is_inference(r.behaviour_logp)


def test_issue61_trap8_a_prompt_without_the_bos_its_tokenizer_adds_is_warned_of(policy, addition):
    """Prompts are tokenized as written (add_special_tokens=False): raw text for a tokenizer that
    adds a BOS reached the model without it, silently. Now a warning names it."""
    from tokenizers.processors import TemplateProcessing
    model, tokenizer = policy
    with_bos = copy.deepcopy(tokenizer)
    with_bos.add_special_tokens({"bos_token": "<s>"})
    with_bos._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", with_bos.bos_token_id)])
    sample = lambda prompts, tok: generate_rollouts(model, tok, prompts, addition.reward,
                                                    num_generations=2, max_new_tokens=2,
                                                    temperature=1.0, policy_version=0)
    with pytest.warns(UserWarning, match="does not begin with '<s>'"):
        sample(["12+34="], with_bos)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*does not begin with")
        sample(["12+34="], tokenizer)        # no BOS added by this one: nothing to say


def test_issue61_trap9_completion_logp_refuses_another_layout(policy):
    """completion_logp reads collate's layout; its only guard was the temperature key. Cols
    missing a key, or a completion_mask as wide as the sequence, now raise one line."""
    model, _ = policy
    cols = collate([hand_built(1.0, baseline=0.5, temperature=1.0)], pad_id=0, eos_ids=HAND_EOS)
    for broken in ({k: v for k, v in cols.items() if k != "position_ids"},
                   {**cols, "completion_mask": torch.ones_like(cols["input_ids"])}):
        with pytest.raises(ValueError, match="collate's layout"):
            completion_logp(model, broken)
    completion_logp(model, cols)


def test_issue61_trap10_the_kl_term_needs_a_peft_model(policy):
    """beta > 0 called disable_adapter, which only PEFT models have: an AttributeError deep in the
    step. Refused in one line by batch_loss (and so update_step)."""
    model, tokenizer = policy
    bare = model.get_base_model()
    rollouts = [hand_built(r, baseline=0.5, temperature=1.0) for r in (1.0, 0.0)]
    optimizer = torch.optim.AdamW([p for p in bare.parameters() if p.requires_grad], lr=1e-3)
    with pytest.raises(ValueError, match="beta 0.1 > 0: .*disable_adapter"):
        update_step(bare, optimizer, rollouts, pad_id=0, eos_ids=HAND_EOS, current_version=0,
                    beta=0.1)


def test_issue61_trap11_help_shows_the_models_own_defaults(capsys):
    """`--model smollm2 --help` showed the demo's defaults (temperature 1.0; it runs at 0.7)."""
    import train
    with pytest.raises(SystemExit):
        train.parse_config(["--model", "smollm2", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--temperature FLOAT sampling temperature" in shown
    assert "(smollm2's default: 0.7)" in shown and "(smollm2's default: sums)" in shown
    with pytest.raises(SystemExit):
        train.parse_config(["--help"])
    assert "(smollm2's default" not in capsys.readouterr().out


def test_issue61_trap12_no_progress_hides_what_its_help_says(capsys):
    """--no-progress said it hid the start-up summary; it hid the end-of-run summary too. The help
    now names both, and the behaviour is that."""
    from infra import report
    import train
    from infra.checkpoint import LoopState
    help_text = next(f.metadata["help"] for f in dataclasses.fields(train.Config)
                     if f.name == "progress")
    assert "start-up and end-of-run summaries" in help_text
    state = LoopState(first_accuracy=0.3, last_accuracy=0.5)
    report.summary(train.Config(progress=False), state, "runs/x")
    assert capsys.readouterr().out == ""
    report.summary(train.Config(), state, "runs/x")
    assert "eval accuracy: 0.300 at step 0 -> 0.500" in capsys.readouterr().out


def test_review_trap_a_buffer_loads_no_more_than_it_holds():
    """load_state_dict filled a ReplayBuffer(4) with a state of 8, and sample drew from all 8 until
    the next add. A state larger than the capacity is refused; one that fits loads whole."""
    full = ReplayBuffer(8, seed=0)
    full.add([hand_built(float(i), baseline=0.5, temperature=1.0) for i in range(8)])
    with pytest.raises(ValueError, match="a state of 8 rollouts into a buffer of capacity 4"):
        load_buffer_state(ReplayBuffer(4, seed=0), buffer_state(full))
    same = ReplayBuffer(8, seed=0)
    load_buffer_state(same, buffer_state(full))
    assert [r.reward for r in same.items] == [float(i) for i in range(8)]


def test_review_trap_remove_and_max_uses_together_are_refused():
    """sample(B, remove=True, max_uses=3) used each rollout once: remove won and max_uses was
    ignored, silently. Both together are refused; each alone acts."""
    buf = ReplayBufferWithVariants(4, seed=0)
    buf.add([hand_built(float(i), baseline=0.5, temperature=1.0) for i in range(4)])
    with pytest.raises(ValueError, match="remove with max_uses 3"):
        buf.sample(2, remove=True, max_uses=3)
    assert len(buf.items) == 4                  # refused before any draw: nothing used or gone
    buf.sample(2, max_uses=2)
    buf.sample(4, max_uses=2)
    assert len(buf.items) == 2 and all(r.uses == 1 for r in buf.items)   # the two used twice left


def test_review_trap_dropout_a_layer_applies_itself_is_found_turned_off_and_refused():
    """OPT keeps its dropout as float attributes (dropout, activation_dropout) that it passes to
    F.dropout itself: load_policy left three at 0.1, sampling in training mode was not refused,
    and an update on fresh rollouts in training mode gave is_ratio_max 1.08, not 1.
    replay_rl.dropout_rates finds them, infra.policy.dropout_off (what load_policy runs) zeroes them,
    refuse_active_dropout refuses them in training mode, and greedy evaluation refuses them too."""
    from transformers import OPTConfig, OPTForCausalLM
    import replay_rl
    import rollout
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                     num_attention_heads=2, max_position_embeddings=64,
                                     word_embed_proj_dim=16, dropout=0.1, attention_dropout=0.1,
                                     activation_dropout=0.1, layerdrop=0.0))
    found = [(name, attr, rate) for name, module, attr, rate in replay_rl.dropout_rates(model)
             if isinstance(module, torch.nn.Module) and not isinstance(module, torch.nn.Dropout)
             and rate > 0]
    assert len(found) >= 2 and all(attr == "dropout" for _, attr, _ in found)    # not nn.Dropout
    model.train()
    with pytest.raises(ValueError, match=r"active dropout \(.*dropout: 0.1\)"):
        rollout.refuse_active_dropout(model)
    with pytest.raises(ValueError, match="active dropout"):
        generation.greedy_rewards(model, None, ["1+1="], {"r": lambda c, p: 0.0}, max_new_tokens=2)
    ids = torch.arange(1, 9).unsqueeze(0)
    outputs = {model(ids).logits.sum().item() for _ in range(2)}
    assert len(outputs) == 2                    # in training mode two forwards differ: dropout acts
    from infra.policy import dropout_off
    dropout_off(model)                          # what load_policy runs
    assert all(rate == 0.0 for *_, rate in replay_rl.dropout_rates(model))
    rollout.refuse_active_dropout(model)        # nothing left to refuse, in training mode
    assert len({model(ids).logits.sum().item() for _ in range(2)}) == 1


# ---- issue 66: the five traps a fresh reader confirmed, each on the bare function ---------------
def tiny_falcon(tmp_path, dropout: float):
    """A tiny Falcon folder (the demo's character tokenizer) whose layers read their dropout from
    the config during the forward (dropout_add(..., self.config.hidden_dropout, ...))."""
    from transformers import FalconConfig, FalconForCausalLM
    from infra.demo_model import char_tokenizer
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    model = FalconForCausalLM(FalconConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        hidden_dropout=dropout, attention_dropout=dropout, pad_token_id=0, eos_token_id=1,
        bos_token_id=1))
    model.save_pretrained(tmp_path / "falcon")
    tokenizer.save_pretrained(tmp_path / "falcon")
    return str(tmp_path / "falcon"), model


def test_t1_dropout_a_layer_reads_from_its_config_is_found_zeroed_and_refused(tmp_path, addition):
    """T1: Falcon reads hidden_dropout from self.config in its forward: load_policy left it at 0.2
    and rho on fresh rollouts was 1.13 at most in training mode. dropout_rates now finds the
    config's rates, refuse_active_dropout refuses them in training mode, and load_policy zeroes
    them: fresh rollouts train at rho = 1."""
    from infra.policy import load_policy
    folder, raw = tiny_falcon(tmp_path, 0.2)
    found = {(attr, rate) for _, owner, attr, rate in replay_rl.dropout_rates(raw)
             if not isinstance(owner, torch.nn.Module)}
    assert ("hidden_dropout", 0.2) in found and ("attention_dropout", 0.2) in found
    raw.train()
    with pytest.raises(ValueError, match=r"active dropout \(.*dropout: 0.2\)"):
        replay_rl.refuse_active_dropout(raw)
    model, tokenizer = load_policy(folder, lora_r=4)
    assert all(rate == 0 for *_, rate in replay_rl.dropout_rates(model))
    assert model.config.hidden_dropout == 0.0
    torch.manual_seed(1)
    rollouts, _ = generate_rollouts(model, tokenizer, addition.train_prompts[:4], addition.reward,
                                    num_generations=4, max_new_tokens=5, policy_version=0)
    model.train()                               # as train.py steps: training mode
    metrics = update_step(model, torch.optim.SGD([p for p in model.parameters()
                                                  if p.requires_grad], lr=0.0),
                          rollouts, pad_id=tokenizer.pad_token_id,
                          eos_ids=end_ids_of(model, tokenizer), current_version=0)
    assert abs(metrics["is_ratio_max"] - 1) < 1e-4 and metrics["approx_kl"] < 1e-7


def test_t2_ppo_takes_no_gradient_through_a_behaviour_logp_that_carries_a_graph():
    """T2: log mu computed by a forward that kept its graph (no torch.no_grad) made the ppo loss's
    gradient flow back through it too; on fresh data the two cancelled to 0. log mu is data: the
    gradient is the same with it detached or not, and not 0."""
    torch.manual_seed(0)
    weights = torch.randn(3, 5, requires_grad=True)
    logp = torch.log_softmax(weights, -1)[:, :4]                 # log pi_theta, [3, 4]
    mask, advantage = torch.ones(3, 4), torch.tensor([1.0, -0.5, 2.0])
    grads = []
    for behaviour in (logp, logp.detach()):                      # with its graph, then without
        weights.grad = None
        loss, _ = policy_loss(logp, behaviour, advantage, mask, loss_type="ppo")
        loss.backward(retain_graph=True)
        grads.append(weights.grad.clone())
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().max() > 1e-3


def test_t3_update_step_refuses_active_dropout_in_training_mode(policy, addition):
    """T3: update_step on a model whose dropout acts in training mode took the step, with
    is_ratio_mean 0.84 on fresh rollouts. It refuses in one line; in eval mode (dropout off) the
    same step runs."""
    model, tokenizer = copy.deepcopy(policy[0]), policy[1]
    rollouts, _ = generate_rollouts(model, tokenizer, ["12+34=", "5+67="], addition.reward,
                                    num_generations=4, max_new_tokens=5, policy_version=0)
    attention = next(m for m in model.modules() if hasattr(m, "attention_dropout"))
    attention.attention_dropout = 0.1
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    model.train()
    with pytest.raises(ValueError, match=r"training mode with active dropout \(.*attention_dropout"):
        update_step(model, optimizer, rollouts, pad_id=tokenizer.pad_token_id,
                    eos_ids=end_ids_of(model, tokenizer), current_version=0)
    model.eval()
    metrics = update_step(model, optimizer, rollouts, pad_id=tokenizer.pad_token_id,
                          eos_ids=end_ids_of(model, tokenizer), current_version=0)
    assert abs(metrics["is_ratio_mean"] - 1) < 1e-5


def test_t4_collate_refuses_prompt_ids_that_carry_padding(policy, addition):
    """T4: prompt_ids sliced from a left-padded batch (sequences[i, :prompt_len]) kept their pads,
    which collate laid out as prompt tokens: log pi and log mu 13 nats apart; a right-padded
    row (a second reader) gave rho 0.02. Both refused."""
    model, tokenizer = policy
    rollouts, _ = generate_rollouts(model, tokenizer, ["12+34=", "5+6="], addition.reward,
                                    num_generations=2, max_new_tokens=5, policy_version=0)
    pad = tokenizer.pad_token_id
    padded = rollouts[2]                                           # "5+6=", two shorter
    unpadded = padded.prompt_ids
    for left, right in (([pad, pad], []), ([], [pad, pad])):      # a left- or right-padded row
        padded.prompt_ids = torch.cat([torch.tensor(left, dtype=torch.long), unpadded,
                                       torch.tensor(right, dtype=torch.long)])
        with pytest.raises(ValueError, match=f"begin or end with the pad id {pad}: store each"):
            collate(rollouts, pad, eos_ids=end_ids_of(model, tokenizer))


def test_t5_the_recorder_refuses_beam_search(policy):
    """T5: generate(num_beams=2, num_return_sequences=2) passed as keywords added no processor the
    recorder saw, and the log mu it returned was of other rows (4.4 nats off). finish() checks that
    the completions are the tokens it gathered, call by call; and since a seventh reader found
    generate(num_beams=2) alone dying of an unrelated stack error before finish, the recorder's
    first call refuses a beam-search decoding loop by name."""
    from transformers import GenerationConfig, LogitsProcessorList
    model, tokenizer = policy
    enc = tokenizer(["12+34=", "5+6="], return_tensors="pt", padding=True, add_special_tokens=False)
    config = GenerationConfig(**rollout.PLAIN_SAMPLING, temperature=1.0, max_new_tokens=4,
                              eos_token_id=[tokenizer.eos_token_id],
                              pad_token_id=tokenizer.pad_token_id)
    for beams in ({}, {"num_beams": 2, "num_return_sequences": 2}, {"num_beams": 2}):
        recorder = BehaviourLogProbs(model, config)
        torch.manual_seed(0)
        generate = lambda: model.generate(**enc, generation_config=config,       # noqa: E731
                                          logits_processor=LogitsProcessorList([recorder]),
                                          **beams)
        if beams:
            with pytest.raises(ValueError, match="beam search"):
                generate()
            continue
        completions = generate()[:, enc.input_ids.shape[1]:]
        logp, _ = recorder.finish(completions)                  # sampling: recorded, row by row
        assert logp.shape == completions.shape
        recorder = BehaviourLogProbs(model, config)              # rows that are not those gathered
        recorder(enc.input_ids, torch.zeros(2, len(tokenizer)))
        recorder(torch.cat([enc.input_ids, completions[:, :1]], 1), torch.zeros(2, len(tokenizer)))
        with pytest.raises(ValueError, match="generate reordered its rows"):
            recorder.finish((completions[:, :1] + 1) % len(tokenizer))


def test_a_mixture_of_experts_router_jitter_is_found_zeroed_and_refused():
    """A second reader: Mixtral's router jitter (router_jitter_noise, a layer's jitter_noise) makes
    the training forward random as dropout does (rho 1.016 at most on fresh data in training
    mode), and the name-based scan missed it. It is found, refused in training mode, zeroed."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from infra.policy import dropout_off
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
        router_jitter_noise=0.2))
    found = {attr for _, _, attr, rate in replay_rl.dropout_rates(model) if rate > 0}
    assert "router_jitter_noise" in found
    model.train()
    with pytest.raises(ValueError, match="training mode with active dropout"):
        replay_rl.refuse_active_dropout(model)
    dropout_off(model)
    replay_rl.refuse_active_dropout(model)
    ids = torch.arange(1, 9)[None]
    assert torch.equal(model(ids).logits, model(ids).logits)      # no longer random


# ---- a fifth reader's traps (docs/reviews/reader-2026-12-07-5.md), each on the bare function ----
def two_prompt_batch(model, tokenizer, reward, G: int = 2, seed: int | None = None):
    """(rollouts, collate's cols) of G fresh samples of two prompts of different lengths (left
    padding in play), the model in eval mode."""
    model.eval()
    if seed is not None:
        torch.manual_seed(seed)
    rollouts, _ = generate_rollouts(model, tokenizer, ["5+7=", "47+38="], reward,
                                    num_generations=G, max_new_tokens=5, policy_version=0)
    return rollouts, collate(rollouts, tokenizer.pad_token_id, 0,
                             eos_ids=end_ids_of(model, tokenizer))


def right_padded(cols: dict, rollouts: list, pad_id: int) -> dict:
    """The reader's own collate: each row prompt + completion, padded on the right, the same
    shapes and completion_mask as collate's (its T1)."""
    ids = torch.full_like(cols["input_ids"], pad_id)
    attention = torch.zeros_like(ids)
    for i, r in enumerate(rollouts):
        row = torch.cat([r.prompt_ids, r.completion_ids])
        ids[i, :len(row)], attention[i, :len(row)] = row, 1
    return dict(cols, input_ids=ids, attention_mask=attention,
                position_ids=(attention.cumsum(1) - 1).clamp(min=0))


def test_reader5_trap1_a_right_padded_batch_is_refused_by_both_completion_logps(policy, addition):
    """Rows padded on the right (prompts of different lengths) scored log pi 20 nats off log mu,
    silently: both completion_logps now check where the tokens are, not only the shapes."""
    model, tokenizer = policy
    rollouts, cols = two_prompt_batch(model, tokenizer, addition.reward, seed=1)
    own = right_padded(cols, rollouts, tokenizer.pad_token_id)
    assert not torch.equal(own["input_ids"], cols["input_ids"])       # the layouts differ
    with torch.no_grad():
        assert largest_log_rho(model, tokenizer, rollouts) < 1e-5       # collate's: rho = 1
        for fn in (lambda c: completion_logp(model, c, 1.0),
                   lambda c: minimal.completion_logp(model, c, 1.0)):
            fn(cols)
            with pytest.raises(ValueError, match="collate's"):
                fn(own)


def test_reader5_trap2_max_grad_norm_0_is_refused_by_both_steps(policy, addition):
    """clip_grad_norm_ at 0 scales every gradient to 0: the weights never moved while the
    reported grad_norm (before clipping) looked healthy. Refused; inf (no clip) takes the step."""
    from infra.engineered_update import update_step_engineered
    model, tokenizer = policy
    rollouts, _ = two_prompt_batch(model, tokenizer, addition.reward, G=4)
    rollouts = [dataclasses.replace(r, advantage=(-1.0) ** i) for i, r in enumerate(rollouts)]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1)
    for step in (update_step, update_step_engineered):
        for bad in (0.0, -1.0):
            with pytest.raises(ValueError, match="max_grad_norm"):
                step(model, optimizer, rollouts, pad_id=tokenizer.pad_token_id,
                     eos_ids=end_ids_of(model, tokenizer), current_version=0, max_grad_norm=bad)
    before = [p.detach().clone() for p in params]
    update_step(model, optimizer, rollouts, pad_id=tokenizer.pad_token_id,
                eos_ids=end_ids_of(model, tokenizer), current_version=0, max_grad_norm=float("inf"))
    assert any(not torch.equal(a, b) for a, b in zip(before, params))


def test_reader5_trap3_minimal_policy_loss_refuses_a_cap_below_1():
    """is_cap 0.2 (epsilon's value taken for C) clamped every weight to 0.2 in minimal.py's loss,
    silently; the module's refused it. Both refuse it now; C = 1 is allowed."""
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    args = (logp, torch.tensor([[-0.7, -0.9]]), torch.tensor([1.5]), torch.ones(1, 2))
    for loss in (minimal.policy_loss, policy_loss):
        with pytest.raises(ValueError, match="is_cap 0.2"):
            loss(*args, is_cap=0.2)
    assert minimal.policy_loss(*args, is_cap=1.0)[0].item() == pytest.approx(
        policy_loss(*args, is_cap=1.0)[0].item())


# ---- a sixth reader's traps (docs/reviews/reader-2026-12-07-6.md), each on the bare piece -------
def test_reader6_trap4_generate_completions_and_the_recorder_refuse_active_dropout(policy):
    """Copied without generate_rollouts, generate_completions (or the recorder with one's own
    generate) sampled a model in training mode with dropout (the reader's: LoRA's 0.1, rho 0.77 on
    average on fresh rollouts), silently. Both refuse it now; in eval mode they sample."""
    model, tokenizer = policy
    attention = next(m for m in model.modules() if hasattr(m, "attention_dropout"))
    attention.attention_dropout = 0.1
    model.train()
    config = GenerationConfig(**PLAIN_SAMPLING, max_new_tokens=3)
    with pytest.raises(ValueError, match="dropout"):
        rollout.generate_completions(model, tokenizer, ["5+7="], 2, max_new_tokens=3,
                                     temperature=1.0)
    with pytest.raises(ValueError, match="dropout"):
        BehaviourLogProbs(model, config)
    model.eval()
    assert rollout.generate_completions(model, tokenizer, ["5+7="], 2, max_new_tokens=3,
                                        temperature=1.0)[1].shape[0] == 2


def test_reader6_trap5_minimal_completion_logp_refuses_a_prompt_padded_on_its_right(policy,
                                                                                    addition):
    """[p p p p pad pad | c c EOS]: the completions in collate's columns, a prompt padded on its
    right scored the first completion token 2 nats off in minimal.py, silently (the module's
    check_layout refused it). Both refuse it now."""
    model, tokenizer = policy
    rollouts, cols = two_prompt_batch(model, tokenizer, addition.reward, seed=1)
    P = cols["input_ids"].shape[1] - cols["completion_mask"].shape[1]
    short = next(i for i, r in enumerate(rollouts) if len(r.prompt_ids) < P)
    ids, attention = cols["input_ids"].clone(), cols["attention_mask"].clone()
    n = len(rollouts[short].prompt_ids)
    ids[short, :P] = tokenizer.pad_token_id
    ids[short, :n] = rollouts[short].prompt_ids
    attention[short, :P] = 0
    attention[short, :n] = 1
    bad = dict(cols, input_ids=ids, attention_mask=attention)
    with torch.no_grad():
        for fn in (lambda c: completion_logp(model, c, 1.0),
                   lambda c: minimal.completion_logp(model, c, 1.0)):
            fn(cols)
            with pytest.raises(ValueError, match="collate's"):
                fn(bad)


def test_reader6_trap7_check_layout_refuses_position_ids_that_count_the_padding(policy, addition):
    """Hand-built cols with arange positions (padding counted): 0.18 nats off on a model with
    learned positions, silently. check_layout refuses positions other than collate's."""
    model, tokenizer = policy
    rollouts, cols = two_prompt_batch(model, tokenizer, addition.reward)
    arange = torch.arange(cols["input_ids"].shape[1]).expand_as(cols["input_ids"])
    assert not torch.equal(arange, cols["position_ids"])         # some row is padded
    with pytest.raises(ValueError, match="position_ids"):
        replay_rl.check_layout(dict(cols, position_ids=arange.clone()))
    replay_rl.check_layout(cols)


# ---- a seventh reader's traps (docs/reviews/reader-2026-12-07-7.md) ------------------------------
def test_reader7_the_greedy_evals_ignore_a_models_own_penalties(policy, addition):
    """A model whose generation_config sets repetition_penalty 3.0 (Qwen2.5-Instruct ships one)
    took 'greedy' accuracy with the penalty applied (0.373 -> 0.207 on the reader's), silently.
    Both greedy evals now decode the plain argmax: the same accuracy with and without it."""
    model, tokenizer = policy
    model.eval()
    prompts = addition.eval_prompts[:40]
    found = {}
    for penalty in (None, 3.0):
        model.generation_config.repetition_penalty = penalty
        found[penalty] = (generation.greedy_accuracy(model, tokenizer, prompts, addition.reward,
                                                  max_new_tokens=addition.max_new_tokens),
                          minimal.evaluate(model, tokenizer, prompts, addition.reward,
                                           addition.max_new_tokens))
    model.generation_config.repetition_penalty = None
    assert found[None] == found[3.0], found
    assert found[None][0] == found[None][1]


def test_reader7_minimal_completion_logp_refuses_positions_that_count_the_padding(policy,
                                                                                  addition):
    """Positions counting the padding scored 0.4-0.6 nats off on learned positions in minimal.py,
    silently (the module refused them). minimal.completion_logp refuses them now."""
    model, tokenizer = policy
    rollouts, cols = two_prompt_batch(model, tokenizer, addition.reward)
    arange = torch.arange(cols["input_ids"].shape[1]).expand_as(cols["input_ids"]).clone()
    with torch.no_grad():
        minimal.completion_logp(model, cols, 1.0)
        with pytest.raises(ValueError, match="collate's"):
            minimal.completion_logp(model, dict(cols, position_ids=arange), 1.0)


@pytest.mark.parametrize("logp_of", ["the whole sequence (0-dim)", "one value"])
def test_reader9_collate_refuses_a_behaviour_logp_that_is_not_one_per_token(logp_of):
    """A Rollout whose behaviour_logp was a whole sequence's log-prob (a 0-dim tensor, as some
    inference servers return) or one value was spread over every completion token by both collates
    ([[-3.0, -3.0, -3.0]]), silently: every importance ratio wrong. Both refuse it now."""
    stored = torch.tensor(-3.0) if logp_of.startswith("the whole") else torch.tensor([-3.0])
    make = lambda cls: cls(prompt_ids=torch.tensor([5, 6]), completion_ids=torch.tensor([7, 8, 9]),
                           behaviour_logp=stored, reward=1.0, advantage=0.5, policy_version=0,
                           temperature=1.0, **({"baseline": 0.5} if cls is Rollout else {}))
    with pytest.raises(ValueError, match="one log mu per completion token"):
        collate([make(Rollout)], pad_id=0, eos_ids=[9])
    with pytest.raises(ValueError, match="log mu of each completion token"):
        minimal.collate([make(minimal.Rollout)], pad_id=0, eos_ids=[9])
    right = make(Rollout)
    right.behaviour_logp = torch.tensor([-1.0, -2.0, -3.0])
    cols = collate([right], pad_id=0, eos_ids=[9])
    assert cols["behaviour_logp"].tolist() == [[-1.0, -2.0, -3.0]]


@pytest.mark.parametrize("shape", [(4, 1), (4,)])
def test_reader10_policy_loss_refuses_a_log_mu_that_is_not_one_per_token(shape):
    """Both policy_losses took a per-sequence log mu ([batch, 1], or [batch]) and broadcast it over
    every token: is_ratio_mean 5.96 on fresh data, no error (the collates refuse it, a copied loss
    did not). Both refuse it now; the right shape still gives rho = 1."""
    logp = -torch.rand(4, 3) - 0.1
    mask, advantage = torch.ones(4, 3), torch.tensor([1.0, -1.0, 0.5, -0.5])
    per_sequence = logp.sum(1).reshape(shape)
    with pytest.raises(ValueError, match=r"behaviour_logp \[" + ", ".join(map(str, shape))):
        policy_loss(logp, per_sequence, advantage, mask)
    with pytest.raises(ValueError, match="must each be"):
        minimal.policy_loss(logp, per_sequence, advantage, mask, is_cap=2.0)
    _, metrics = policy_loss(logp, logp.clone(), advantage, mask)
    assert metrics["is_ratio_mean"].item() == pytest.approx(1.0)


def test_reader12_a_reward_that_is_not_finite_is_refused(policy, addition):
    """generate_rollouts (both) took a NaN reward silently: A NaN for its group, and every update
    that drew the group skipped (loss nan, skipped 1). Both refuse it now, in one line."""
    model, tokenizer = policy
    model.eval()
    for bad in (math.nan, math.inf):
        reward = lambda prompt, completion, bad=bad: bad if prompt == "12+34=" else 1.0
        with pytest.raises(ValueError, match=f"reward_fn returned {bad}"):
            generate_rollouts(model, tokenizer, ["12+34=", "5+6="], reward, num_generations=2,
                              max_new_tokens=3, policy_version=0)
        with pytest.raises(ValueError, match="not finite"):
            minimal.generate_rollouts(model, tokenizer, ["12+34=", "5+6="], reward,
                                      num_generations=2, max_new_tokens=3, temperature=1.0,
                                      policy_version=0)
    rollouts, _ = generate_rollouts(model, tokenizer, ["12+34="], lambda p, c: 0.5,
                                    num_generations=2, max_new_tokens=3, policy_version=0)
    assert [r.reward for r in rollouts] == [0.5, 0.5]


@pytest.mark.parametrize("dropout", [torch.nn.AlphaDropout, torch.nn.Dropout1d,
                                     torch.nn.FeatureAlphaDropout])
def test_reader13_every_torch_dropout_class_is_found_and_refused(dropout):
    """AlphaDropout and Dropout1d are not subclasses of nn.Dropout: in training mode they passed
    refuse_active_dropout while two forwards differed (rho != 1 on fresh data), silently. Every
    subclass of torch's _DropoutNd is found now; at rate 0, or in eval mode, none is refused."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), dropout(0.2), torch.nn.Linear(4, 2))
    model.train()
    found = [(attr, rate) for _, _, attr, rate in replay_rl.dropout_rates(model)]
    assert found == [("p", 0.2)]
    with pytest.raises(ValueError, match="active dropout"):
        replay_rl.refuse_active_dropout(model)
    model.eval()
    replay_rl.refuse_active_dropout(model)
    model.train()
    model[1].p = 0.0
    replay_rl.refuse_active_dropout(model)


def test_collate_refuses_tokens_after_the_first_end_token():
    """A completion stored with one pad after its EOS ([a, b, EOS, PAD], pad != eos) passed both
    collates: its completion_mask is by length, so the pad was trained on, silently. Both refuse
    it now (they take the end ids, eos_ids); the same rows trimmed after their EOS pass."""
    a, b, eos, pad = 7, 8, 2, 0
    make = lambda cls, ids: cls(prompt_ids=torch.tensor([5, 6]), completion_ids=torch.tensor(ids),
                                behaviour_logp=-torch.ones(len(ids)), reward=1.0, advantage=0.5,
                                policy_version=0, temperature=1.0,
                                **({"baseline": 0.5} if cls is Rollout else {}))
    with pytest.raises(ValueError, match="after its first end token"):
        collate([make(Rollout, [a, b, eos, pad])], pad_id=pad, eos_ids=[eos])
    with pytest.raises(ValueError, match="after its first end token"):
        minimal.collate([make(minimal.Rollout, [a, b, eos, pad])], pad_id=pad, eos_ids=[eos])
    trimmed = [make(Rollout, [a, b, eos]), make(Rollout, [a])]     # one cut at max_new_tokens
    assert collate(trimmed, pad_id=pad, eos_ids=[eos])["completion_mask"].tolist() == [
        [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    mine = [make(minimal.Rollout, [a, b, eos]), make(minimal.Rollout, [a])]
    assert minimal.collate(mine, pad_id=pad, eos_ids=[eos])["completion_mask"].tolist() == [
        [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
