"""--dtype float16 (GPUs without bfloat16), on CPU: fp16 base weights; LoRA weights, AdamW's state,
the log-probs and the loss in fp32; the loss scaled in backward and the gradient unscaled."""
import json

import pytest
import torch

from infra import loading
import replay_rl
from infra import engineered_update
import train
from buffer import collate
from rollout import end_token_ids, generate_rollouts


def policy_and_rollouts(addition, dtype="float16"):
    model, tok, _ = loading.load_model(train.Config(dtype=dtype, lora_r=4), addition, "cpu", 0)
    for name, p in model.named_parameters():     # a non-zero adapter: every LoRA weight has a gradient
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    torch.manual_seed(1)
    prompts = ["1+2=", "45+67=", "9+99=", "80+0="]
    rollouts, _ = generate_rollouts(model, tok, prompts, addition.reward, num_generations=4, max_new_tokens=5, policy_version=0)
    for i, r in enumerate(rollouts):              # varied advantages, stale log-probs: every term matters
        r.advantage = float(i % 5) - 2.0
        r.behaviour_logp = r.behaviour_logp - 0.1 * (i % 3)
    return model, tok, rollouts


def gradient(model, tok, rollouts, loss_scale, max_grad_norm=1e9, metrics=None):
    """The gradient update_step_engineered leaves in p.grad (SGD at lr 0: the weights stay), clipped at
    max_grad_norm (by default never); its metrics go into ``metrics``."""
    params = [p for p in model.parameters() if p.requires_grad]
    m = engineered_update.update_step_engineered(model, torch.optim.SGD(params, lr=0.0), rollouts, pad_id=tok.pad_token_id,
                              eos_ids=end_token_ids(model, tok)[0], current_version=0,
                              max_grad_norm=max_grad_norm, loss_scale=loss_scale)
    (metrics if metrics is not None else {}).update(m)
    return torch.cat([p.grad.flatten() for p in params])


def test_float16_keeps_lora_optimizer_and_log_probs_in_float32(tiny_path, addition):
    model, tok, rollouts = policy_and_rollouts(addition)
    base = {p.dtype for n, p in model.named_parameters() if "lora_" not in n}
    lora = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert base == {torch.float16} and lora == {torch.float32}     # peft's autocast_adapter_dtype
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    batch = collate(rollouts, tok.pad_token_id, 0, eos_ids=end_token_ids(model, tok)[0])
    logp, entropy = replay_rl.completion_logp(model, batch)
    assert logp.dtype == entropy.dtype == torch.float32
    loss, _ = replay_rl.policy_loss(logp, batch["behaviour_logp"], batch["advantage"], batch["completion_mask"])
    assert loss.dtype == torch.float32
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    m = engineered_update.update_step_engineered(model, optimizer, rollouts, pad_id=tok.pad_token_id,
                              eos_ids=end_token_ids(model, tok)[0], current_version=0, loss_scale=engineered_update.FP16_LOSS_SCALE)
    assert m["skipped"] == 0 and m["grad_norm"] > 0
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and {t.dtype for t in states} == {torch.float32}


def test_the_scaled_gradient_unscaled_is_the_gradient_of_the_loss(tiny_path, addition):
    """In float32 (where S = 2^10 is exact, so this shows where the division happens, not that it
    helps; the next test does that): grad(S * L) / S from update_step_engineered equals autograd's grad(L) of
    the loss that completion_logp and policy_loss give, and it is unscaled before clipping (the
    clipped gradient and the logged grad_norm are those of L, not of S * L)."""
    model, tok, rollouts = policy_and_rollouts(addition, "float32")
    batch = collate(rollouts, tok.pad_token_id, 0, eos_ids=end_token_ids(model, tok)[0])
    logp, _ = replay_rl.completion_logp(model, batch)
    loss, _ = replay_rl.policy_loss(logp, batch["behaviour_logp"], batch["advantage"], batch["completion_mask"])
    by_hand = torch.cat([g.flatten() for g in torch.autograd.grad(
        loss, [p for p in model.parameters() if p.requires_grad])])
    assert by_hand.abs().sum() > 0
    for scale in (1.0, engineered_update.FP16_LOSS_SCALE):
        torch.testing.assert_close(gradient(model, tok, rollouts, scale), by_hand, rtol=1e-5, atol=1e-8)
    clip = 0.1 * float(by_hand.norm())                     # clipping active: the gradient cut to 1/10
    plain, scaled = {}, {}
    g1 = gradient(model, tok, rollouts, 1.0, clip, plain)
    gs = gradient(model, tok, rollouts, engineered_update.FP16_LOSS_SCALE, clip, scaled)
    torch.testing.assert_close(g1, by_hand * 0.1, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(gs, g1, rtol=1e-5, atol=1e-9)
    assert scaled["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert plain["grad_norm"] == pytest.approx(float(by_hand.norm()), rel=1e-4)


def test_the_loss_scale_keeps_small_float16_gradients_from_underflowing(tiny_path, addition):
    """Small advantages (x 1e-3) give activation gradients below fp16's range: unscaled, some LoRA
    gradients come out 0 and the whole is ~3% off the float32 gradient of the same weights; scaled
    by FP16_LOSS_SCALE, ~0.3% (fp16 rounding)."""
    model, tok, rollouts = policy_and_rollouts(addition)
    for r in rollouts:
        r.advantage *= 1e-3
    plain, scaled = (gradient(model, tok, rollouts, s) for s in (1.0, engineered_update.FP16_LOSS_SCALE))
    reference = gradient(model.float(), tok, rollouts, 1.0)

    def error(g):
        return float((g - reference).norm() / reference.norm())
    assert error(scaled) < 0.01 and error(plain) > 2 * error(scaled), (error(plain), error(scaled))
    assert (plain == 0).sum() > 0 and (scaled == 0).sum() == 0 == (reference == 0).sum()


@pytest.mark.slow
def test_float16_run_learns_without_skipped_steps(tmp_path, tiny_path, capsys):
    """10 on-policy rounds of the demo in float16 (~20 s on one CPU core): measured 0.300 -> 0.88-0.90
    held-out accuracy on 200 prompts (seeds 0-2), no skipped step."""
    result = train.main(["--dtype", "float16", "--output-dir", str(tmp_path), "--max-rounds", "10",
                         "--prompts-per-round", "16", "--buffer-size", "128", "--batch-size", "128",
                         "--eval-every", "10", "--eval-prompts", "200", "--no-plot"])
    assert "(float16)" in capsys.readouterr().out                     # the start-up line names the dtype
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "eval_accuracy" not in r]
    assert len(steps) == 10 and all(r["skipped"] == 0 for r in steps)
    assert steps[-1]["is_ratio_mean"] == pytest.approx(1.0, abs=0.01)  # generation and training agree
    gain = result["final_accuracy"] - result["first_accuracy"]
    assert gain >= 0.2, (result["first_accuracy"], result["final_accuracy"])
