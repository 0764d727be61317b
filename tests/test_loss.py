"""The loss against hand-computed values and gradients.

Setup used throughout: two sequences, the second one padded after 2 tokens, so the batch has
5 real tokens. Gradients are taken with respect to logp itself: for token_mean,
d L / d logp_t = -(weight_t * A) / 5 on real tokens and 0 on padding.
"""
import math

import pytest
import torch

from replay_rl import policy_loss
from infra import policy

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])


def run(logp_values, behaviour_values, **kw):
    logp = torch.tensor(logp_values, requires_grad=True)
    loss, metrics = policy_loss(logp, torch.tensor(behaviour_values), ADV, MASK, **kw)
    loss.backward()
    return loss.item(), logp.grad, metrics


def test_on_policy_ratio_one_is_plain_policy_gradient():
    lp = [[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]]
    for loss_type in ("tis", "ppo"):
        loss, grad, m = run(lp, lp, loss_type=loss_type)
        # d/dlogp of -A * logp (tis) and of -A * exp(logp - mu) at rho = 1 (ppo) are both -A
        expected = torch.tensor([[-1.0, -1.0, -1.0], [2.0, 2.0, 0.0]]) / 5
        assert torch.allclose(grad, expected), loss_type
        assert m["is_ratio_mean"] == pytest.approx(1.0) and m["is_truncated_frac"] == 0.0
        assert m["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    loss, _, _ = run(lp, lp, loss_type="tis")
    # tis value: -(1*(-0.5-1-2) + (-2)*(-0.3-0.7)) / 5 = -(-3.5 + 2) / 5 = 0.3
    assert loss == pytest.approx(0.3)


def test_tis_truncates_the_weight_at_the_cap_without_gradient_through_it():
    lp = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
    mu = [[-1.0 - math.log(3.0), -1.0 - math.log(0.5), -1.0], [-1.0 - math.log(2.5), -1.0, -5.0]]
    loss, grad, m = run(lp, mu, loss_type="tis", is_cap=2.0)
    # ratios: [3, 0.5, 1], [2.5, 1, (pad)] -> weights [2, 0.5, 1], [2, 1]
    expected = torch.tensor([[-2.0, -0.5, -1.0], [2 * 2.0, 2 * 1.0, 0.0]]) / 5
    assert torch.allclose(grad, expected, atol=1e-6)
    # value: -(1*(2+0.5+1)*(-1) + (-2)*(2+1)*(-1)) / 5 = -(-3.5 + 6) / 5 = -0.5
    assert loss == pytest.approx(-0.5, abs=1e-6)
    assert m["is_truncated_frac"] == pytest.approx(2 / 5)
    assert m["is_ratio_max"] == pytest.approx(3.0)
    assert m["is_ratio_mean"] == pytest.approx((3 + 0.5 + 1 + 2.5 + 1) / 5)
    # approx_kl = mean(rho - 1 - log rho) over real tokens
    kl = sum(r - 1 - math.log(r) for r in (3, 0.5, 1, 2.5, 1)) / 5
    assert m["approx_kl"] == pytest.approx(kl, rel=1e-5)


def test_ppo_clips_only_where_the_clipped_term_is_smaller():
    lp = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    # ratios: seq 0 (A=+1): 1.5, 0.5, 1.1; seq 1 (A=-2): 1.5, 0.5
    mu = [[-math.log(1.5), -math.log(0.5), -math.log(1.1)], [-math.log(1.5), -math.log(0.5), 0.0]]
    loss, grad, m = run(lp, mu, loss_type="ppo", epsilon=0.2)
    # A>0, rho=1.5: min(1.5, 1.2) -> clipped, no gradient;   A>0, rho=0.5: min(0.5, 0.8) -> unclipped
    # A>0, rho=1.1: inside the range;  A<0, rho=1.5: min(-3, -2.4) = -3 unclipped;  A<0, rho=0.5: clipped
    # unclipped gradient of -rho*A w.r.t. logp is -rho*A
    expected = torch.tensor([[0.0, -0.5, -1.1], [1.5 * 2, 0.0, 0.0]]) / 5
    assert torch.allclose(grad, expected, atol=1e-6)
    value = -(1.2 + 0.5 + 1.1 + (-3.0) + (-2 * 0.8)) / 5
    assert loss == pytest.approx(value, abs=1e-6)
    assert m["is_truncated_frac"] == pytest.approx(2 / 5)


def test_sequence_mean_averages_within_then_across_sequences():
    lp = [[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]]
    loss, grad, _ = run(lp, lp, loss_type="tis", normalization="sequence_mean")
    # seq 0: -1*(-3.5)/3;  seq 1: 2*(-1.0)/2;  mean over the 2 sequences
    assert loss == pytest.approx((3.5 / 3 - 1.0) / 2)
    expected = torch.tensor([[-1 / 3, -1 / 3, -1 / 3], [2 / 2, 2 / 2, 0.0]]) / 2
    assert torch.allclose(grad, expected)


def test_unknown_names_are_refused():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(lp, lp, ADV, MASK, loss_type="reinforce")
    with pytest.raises(ValueError, match="normalization"):
        policy_loss(lp, lp, ADV, MASK, normalization="sum")


def test_kl_to_reference_by_hand():
    lp = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
    ref = torch.tensor([[-1.0 + math.log(2.0), -1.0, -1.0], [-1.0, -1.0 - math.log(2.0), 0.0]])
    logp = torch.tensor(lp, requires_grad=True)
    loss, m = policy_loss(logp, torch.tensor(lp), ADV, MASK, ref_logp=ref, beta=0.5)
    loss.backward()
    # kl_t = e^d - d - 1 with d = ref - logp: d = ln 2 -> 1 - ln 2;  d = -ln 2 -> 0.5 + ln 2 - 1
    kl = ((1 - math.log(2)) + (math.log(2) - 0.5)) / 5
    assert m["ref_kl"] == pytest.approx(kl, rel=1e-5)
    # policy term: -(1 * (-3) + (-2) * (-2)) / 5 = -0.2
    assert loss.item() == pytest.approx(-0.2 + 0.5 * kl, rel=1e-5)
    # d kl_t / d logp_t = 1 - e^d: -1 for d = ln 2, +0.5 for d = -ln 2; plus the policy term -A/5
    expected = torch.tensor([[-1.0 + 0.5 * -1.0, -1.0, -1.0], [2.0, 2.0 + 0.5 * 0.5, 0.0]]) / 5
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_a_per_token_advantage_is_refused_not_broadcast():
    """advantage is one value per rollout, [batch]. A per-token [batch, completion_len] would
    broadcast to [batch, batch, completion_len] and give a loss without an error: it must raise.
    The per-rollout advantage, copied along the tokens, still gives the hand-computed 0.3."""
    lp = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]])
    per_token = ADV[:, None].expand(2, 3)                        # the same numbers, the wrong shape
    for kw in ({"loss_type": "tis"}, {"loss_type": "ppo"}):
        with pytest.raises(ValueError, match=r"shape \[batch\] = \[2\]"):
            policy_loss(lp, lp, per_token, MASK, **kw)
    with pytest.raises(ValueError, match="one value per rollout"):
        policy_loss(lp, lp, None, MASK, loss_type="asymre", reward=torch.ones(2, 3), baseline=torch.zeros(2, 1))
    loss, _ = policy_loss(lp, lp, per_token[:, 0], MASK)
    assert loss.item() == pytest.approx(0.3)


def test_asymre_is_reinforce_with_the_given_coefficient_and_no_ratio():
    lp = [[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]]
    mu = [[-5.0, -0.1, -2.0], [-0.3, -3.0, -9.0]]               # stale: must not matter
    # coefficients r - (V - tau): r = 1, V = 0.25, tau = 0.1 -> 0.85;  r = 0, V = 0.25 -> -0.15
    logp = torch.tensor(lp, requires_grad=True)
    loss, _ = policy_loss(logp, torch.tensor(mu), None, MASK, loss_type="asymre", reward=torch.tensor([1.0, 0.0]),
                          baseline=torch.tensor([0.25, 0.25]), asymre_tau=0.1)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.85 * -3.5 + -0.15 * -1.0) / 5)
    expected = torch.tensor([[-0.85, -0.85, -0.85], [0.15, 0.15, 0.0]]) / 5
    assert torch.allclose(logp.grad, expected)


def test_asymre_takes_reward_and_baseline_never_the_normalized_advantage():
    """The trap of copying policy_loss alone: asymre's coefficient is r - (V - tau), not the
    group-normalized advantage. Passed both, it uses r and V; passed the advantage alone, it refuses."""
    lp = [[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]]
    # two members of a group whose rewards are [1, 0, 0, 0]: V = 0.25, sample std 0.5, so the
    # normalized advantages are (1 - 0.25) / 0.5 = 1.5 and (0 - 0.25) / 0.5 = -0.5
    reward, baseline, normalized = torch.tensor([1.0, 0.0]), torch.tensor([0.25, 0.25]), torch.tensor([1.5, -0.5])
    logp = torch.tensor(lp, requires_grad=True)
    loss, _ = policy_loss(logp, torch.tensor(lp), normalized, MASK, loss_type="asymre", reward=reward,
                          baseline=baseline, asymre_tau=0.1)
    loss.backward()
    # r - (V - tau) = 0.85 and -0.15; with the advantages it would be -(1.5 * -3.5 - 0.5 * -1.0) / 5 = 0.95
    assert loss.item() == pytest.approx(-(0.85 * -3.5 + -0.15 * -1.0) / 5)           # = 0.565
    assert torch.allclose(logp.grad, torch.tensor([[-0.85, -0.85, -0.85], [0.15, 0.15, 0.0]]) / 5)
    tau_zero, _ = policy_loss(logp, torch.tensor(lp), normalized, MASK, loss_type="asymre", reward=reward,
                              baseline=baseline, asymre_tau=0.0)
    assert tau_zero.item() == pytest.approx(-(0.75 * -3.5 + -0.25 * -1.0) / 5)       # tau shifts V
    with pytest.raises(ValueError, match="reward and baseline"):
        policy_loss(logp, torch.tensor(lp), normalized, MASK, loss_type="asymre")


def test_asymre_update_step_weighs_by_reward_and_baseline(tiny_path, addition):
    """update_step_engineered passes each rollout's reward and group baseline to the asymre loss: its stored
    advantage, set to nonsense here, does not enter."""
    import replay_rl
    from infra import engineered_update
    from buffer import collate
    from rollout import end_token_ids, generate_rollouts
    torch.manual_seed(0)
    model, tok = policy.load_policy(tiny_path, lora_r=4)
    rollouts, _ = generate_rollouts(model, tok, ["1+2=", "45+67=", "9+99="], addition.reward, num_generations=4,
                                    max_new_tokens=5, policy_version=0)
    for i, r in enumerate(rollouts):    # each group's rewards [1, 0, 0, 1]: V = 0.5, so r - (V - 0.1) = 0.6 / -0.4
        r.reward, r.baseline, r.advantage = float(i % 4 in (0, 3)), 0.5, 100.0
    eos_ids = end_token_ids(model, tok)[0]
    batch = collate(rollouts, tok.pad_token_id, eos_ids=eos_ids)
    with torch.no_grad():
        logp, _ = replay_rl.completion_logp(model, batch)
    coefficient = torch.tensor([0.6 if i % 4 in (0, 3) else -0.4 for i in range(len(rollouts))])
    mask = batch["completion_mask"]
    expected = -(coefficient[:, None] * logp * mask).sum() / mask.sum()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    m = engineered_update.update_step_engineered(model, optimizer, rollouts, pad_id=tok.pad_token_id,
                                                 eos_ids=eos_ids, current_version=0,
                                                 loss_type="asymre", asymre_tau=0.1)
    assert m["loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_readme_s_loss_section_holds_policy_loss_and_its_helpers_alone():
    """The README names the section to copy for the loss by its two marker lines: it holds
    policy_loss and the helpers it calls, and no other function."""
    import ast
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = " ".join(open(os.path.join(root, "README.md")).read().split())
    start, end = re.search(r"`policy_loss` and its helpers \(the section `(# ---- [^`]+)` of "
                           r"`replay_rl.py`, up to `(# ---- [^`]+)`, with `LOSS_TYPES` and "
                           r"`NORMALIZATIONS`", readme).groups()
    lines = open(os.path.join(root, "replay_rl.py")).read().splitlines()
    first = next(i for i, line in enumerate(lines, 1) if line.startswith(start))
    last = next(i for i, line in enumerate(lines, 1) if line.startswith(end))
    source = open(os.path.join(root, "replay_rl.py")).read()
    functions = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    loss = functions["policy_loss"]
    helpers = {c.func.id for c in ast.walk(loss) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
               and c.func.id in functions}
    assert helpers == {"advantage_term", "masked_mean", "loss_metrics"}
    inside = {name for name, fn in functions.items() if first <= fn.lineno and fn.end_lineno <= last}
    assert inside == helpers | {"policy_loss"}
    # the helpers check names against the two tuples the README names with them, and nothing else of the module
    names = {n.id for fn in [loss, *(functions[h] for h in helpers)] for n in ast.walk(fn) if isinstance(n, ast.Name)}
    assert names & {n.targets[0].id for n in ast.parse(source).body if isinstance(n, ast.Assign)} == {
        "LOSS_TYPES", "NORMALIZATIONS"}


def test_policy_loss_brings_its_own_guards():
    """Called bare, as a reader who copies it would: a cap below 1, a clip range outside (0, 1), a
    negative beta, and a KL term without reference log-probs are refused, the values named."""
    lp = [[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]]
    for kw, name in [(dict(is_cap=0.5), "is_cap 0.5"), (dict(epsilon=0.0), "epsilon 0.0"),
                     (dict(epsilon=-0.2, loss_type="ppo"), "epsilon -0.2"), (dict(beta=-1.0), "beta -1.0"),
                     (dict(beta=0.1), "needs ref_logp")]:
        with pytest.raises(ValueError, match=name):
            run(lp, lp, **kw)
    assert run(lp, lp, is_cap=1.0)[0] == pytest.approx(0.3)         # the edge itself is allowed


def test_a_nan_at_a_padded_position_does_not_reach_the_loss():
    """Masks select, not multiply: NaN * 0 is NaN, so a NaN log-prob where the mask is 0 (padding)
    would poison the loss, its gradient and the metrics."""
    lp = [[-0.5, -1.0, -2.0], [-0.3, -0.7, float("nan")]]            # MASK is 0 at [1, 2]
    for normalization in ("token_mean", "sequence_mean"):
        loss, grad, m = run(lp, [[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]], normalization=normalization)
        assert math.isfinite(loss) and torch.isfinite(grad).all(), normalization
        assert all(math.isfinite(float(v)) for v in m.values()), normalization
    loss, _, _ = run(lp, [[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]])
    assert loss == pytest.approx(0.3)                                  # the value without the NaN


def test_the_temperature_check_cannot_be_skipped():
    """completion_logp and its chunked twin refuse a batch that does not say its sampling
    temperature (one not from collate), and a temperature at which sampling is greedy in effect;
    no model is called before the refusal."""
    from replay_rl import completion_logp
    from infra.engineered_update import chunked_completion_logp
    no_model = lambda *a, **k: pytest.fail("the model was called")
    cols = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "completion_mask": torch.ones(1, 2)}
    for fn in (completion_logp, chunked_completion_logp):
        with pytest.raises(ValueError, match="no 'temperature'"):
            fn(no_model, cols, 1.0)
        with pytest.raises(ValueError, match="0.001 < 0.01"):
            fn(no_model, {**cols, "temperature": 0.001}, 0.001)
        with pytest.raises(ValueError, match="sampled at temperature 0.7 but log pi_theta is taken at 1"):
            fn(no_model, {**cols, "temperature": 0.7}, 1.0)
