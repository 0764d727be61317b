"""engineered_update.chunked_completion_logp (train.py's --logp-chunk): completion_logp's values and the
same LoRA gradients, in float32, for every loss and normalization, with and without a temperature,
on the tiny model (a Llama with a tied lm_head) and a small random Qwen2 (untied); the models it
leaves to the plain path; no [tokens, vocab] tensor kept for the backward. Its memory:
tests/test_memory_estimate.py."""
import copy
import dataclasses
import math

import pytest

from infra import engineered_update
import torch

from buffer import Rollout, collate
from replay_rl import LOSS_TYPES, NORMALIZATIONS, batch_loss, completion_logp
from infra.policy import load_policy
from infra.engineered_update import chunked_completion_logp, update_step_engineered

RTOL = 1e-5     # of each compared tensor's largest magnitude (values near 0 have no relative error)


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: the error relative to the tensor's scale."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def entropy_close(a: torch.Tensor, b: torch.Tensor, model) -> bool:
    """Entropies within RTOL of their range, log(vocab): near 0 the plain one, log Z - sum_v p_v
    u_v, cancels to ~1e-5 of it in float32 (the chunked one, shifted by the row maximum, less)."""
    vocab = model.get_base_model().config.vocab_size
    return (a - b).abs().max().item() <= RTOL * math.log(vocab)


def small_qwen2(folder) -> str:
    """A random Qwen2 of 2 layers (0.02M parameters), untied lm_head, the character tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from infra.demo_model import char_tokenizer
    tokenizer = char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def with_moved_adapter(path: str):
    """load_policy's model (float32) with its LoRA B off zero, so that every LoRA weight has a
    gradient and the adapter is not the base (the KL term is not 0); and its pad id."""
    torch.manual_seed(1)                    # LoRA A's initialization, then B's
    model, tokenizer = load_policy(path, lora_r=4)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    model.train()
    return model, tokenizer.pad_token_id


@pytest.fixture(scope="module")
def models(tiny_path, tmp_path_factory):
    return {"tiny llama, tied": with_moved_adapter(tiny_path),
            "qwen2, untied": with_moved_adapter(small_qwen2(tmp_path_factory.mktemp("qwen2")))}


EOS_IDS = [1]   # the character tokenizer's EOS; batch() draws its tokens from 3 up, never an end


def batch(model, pad_id: int, temperature: float, rows: int = 7):
    """Rollouts of random tokens: prompts and completions of different lengths (left and right
    padding), behaviour log-probs up to 0.3 off the model's own (ratios ~0.7 to ~1.4: tis truncates
    at C = 1.2, ppo clips), advantages, rewards and baselines of both signs."""
    g = torch.Generator().manual_seed(0)
    vocab = model.get_base_model().config.vocab_size
    lengths = [2 + (5 * i) % 9 for i in range(rows)]
    rollouts = [Rollout(prompt_ids=torch.randint(3, vocab, (4 + i % 3,), generator=g),
                        completion_ids=torch.randint(3, vocab, (n,), generator=g),
                        behaviour_logp=torch.zeros(n), reward=float(i % 2), advantage=i / 3 - 1,
                        policy_version=0, baseline=0.4, temperature=temperature)
                for i, n in enumerate(lengths)]
    with torch.no_grad():
        logp, _ = completion_logp(model, collate(rollouts, pad_id, 0, eos_ids=EOS_IDS), temperature)
    logp += 0.3 * (2 * torch.rand(logp.shape, generator=g) - 1)
    return [dataclasses.replace(r, behaviour_logp=logp[i, :n])
            for i, (r, n) in enumerate(zip(rollouts, lengths))]


def loss_and_grads(model, cols, log_probs, **loss_args):
    model.zero_grad(set_to_none=True)
    loss, metrics, entropy = batch_loss(model, cols, logp_fn=log_probs, **loss_args)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    return loss.detach(), {k: v.item() for k, v in metrics.items()}, entropy, grads


def in_chunks_of(chunk: int):
    return lambda model, cols, temperature: chunked_completion_logp(model, cols, temperature, chunk)


@pytest.mark.parametrize("model_name", ["tiny llama, tied", "qwen2, untied"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_chunked_loss_and_lora_gradients_are_the_plain_ones(models, model_name, temperature,
                                                                normalization, loss_type):
    """batch_loss with completion_logp, and with chunked_completion_logp in chunks of 5 tokens
    (several chunks, the last one short); beta = 0.1: the reference's log-probs (adapter off) go
    through it too."""
    model, pad_id = models[model_name]
    cols = collate(batch(model, pad_id, temperature), pad_id, 0, eos_ids=EOS_IDS)
    args = dict(temperature=temperature, loss_type=loss_type, normalization=normalization,
                is_cap=1.2, beta=0.1)
    loss, metrics, entropy, grads = loss_and_grads(model, cols, None, **args)
    chunked = loss_and_grads(model, cols, in_chunks_of(5), **args)
    real = cols["completion_mask"].bool()
    # the loss sums terms of both signs (advantages of both signs): within RTOL of their size,
    # mean |log pi| x the largest coefficient of log pi, not of their sum, which may nearly cancel
    with torch.no_grad():
        logp = completion_logp(model, cols, temperature)[0][real]
    coef = torch.cat([cols["advantage"], cols["reward"] - cols["baseline"] + 0.1]).abs().max()
    assert (chunked[0] - loss).abs() <= RTOL * logp.abs().mean() * coef
    for name, value in metrics.items():
        assert chunked[1][name] == pytest.approx(value, rel=RTOL, abs=1e-7), name
    assert entropy_close(chunked[2][real], entropy[real], model) and (chunked[2][~real] == 0).all()
    assert grads.abs().max() > 1e-6                                 # a gradient at all
    assert close(chunked[3], grads) <= RTOL
    if loss_type == "tis":              # the data exercise the cap and the ratios both ways
        assert 0 < metrics["is_truncated_frac"] < 1 and metrics["is_ratio_max"] > 1.2


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_chunked_log_probs_are_the_plain_ones_and_0_on_padding(models, temperature):
    model, pad_id = models["qwen2, untied"]
    cols = collate(batch(model, pad_id, temperature), pad_id, 0, eos_ids=EOS_IDS)
    real = cols["completion_mask"].bool()
    with torch.no_grad():
        logp, entropy = completion_logp(model, cols, temperature)
        for chunk in (1, 4, real.sum().item(), 10_000):    # one token, several, all, one chunk
            chunked_logp, chunked_entropy = chunked_completion_logp(model, cols, temperature, chunk)
            assert close(chunked_logp[real], logp[real]) <= RTOL
            assert entropy_close(chunked_entropy[real], entropy[real], model)
            assert (chunked_logp[~real] == 0).all() and (chunked_entropy[~real] == 0).all()


def test_update_step_engineered_takes_the_same_step_with_chunks(models):
    """train.py's engineered step with log-probs in chunks of 3 and without (plain), micro-batches
    of 3: the same weights."""
    model, pad_id = models["tiny llama, tied"]
    rollouts = batch(model, pad_id, 1.0)
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]
    after = {}
    for chunk in (0, 3):
        trained = copy.deepcopy(model)
        m = update_step_engineered(trained, torch.optim.SGD(trainable(trained), lr=0.5), rollouts,
                                   pad_id=pad_id, eos_ids=EOS_IDS, current_version=0,
                                   micro_batch_size=3,
                                   logp_fn=engineered_update.logp_fn(chunk), max_grad_norm=1e3)
        after[chunk] = m, torch.cat([p.detach().flatten() for p in trainable(trained)])
    (plain, weights), (chunked, chunked_weights) = after[0], after[3]
    for name in ("loss", "is_ratio_mean", "approx_kl", "grad_norm"):
        assert chunked[name] == pytest.approx(plain[name], rel=RTOL), name
    vocab = model.get_base_model().config.vocab_size
    assert chunked["entropy"] == pytest.approx(plain["entropy"], abs=RTOL * math.log(vocab))
    before = torch.cat([p.detach().flatten() for p in trainable(model)])
    assert close(chunked_weights - before, weights - before) <= RTOL
    assert (weights - before).abs().max() > 1e-4


def test_no_tokens_by_vocabulary_tensor_is_kept_for_the_backward(models):
    """What autograd saves in the chunked forward: nothing with the vocabulary as a dimension (the
    plain path keeps its [batch, completion_len, vocab] logits)."""
    model, pad_id = models["qwen2, untied"]
    cols = collate(batch(model, pad_id, 0.7), pad_id, 0, eos_ids=EOS_IDS)
    vocab = model.get_base_model().config.vocab_size
    weights = {tuple(p.shape) for p in model.parameters()}
    for fn, keeps_logits in ((completion_logp, True), (chunked_completion_logp, False)):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t,
                                                      lambda t: t):
            fn(model, cols, 0.7)
        assert any(vocab in s for s in shapes if s not in weights) == keeps_logits, shapes


def test_models_whose_logits_are_not_the_head_alone_take_the_plain_path(models, tmp_path):
    """A soft-capped head (Gemma 2: tanh(z / cap) * cap after lm_head) and a trainable lm_head: the
    plain completion_logp's values exactly, and the trainable head gets its gradient."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from infra.demo_model import char_tokenizer
    tokenizer = char_tokenizer()
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, max_position_embeddings=128, final_logit_softcapping=0.5,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                          bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    gemma, pad_id = with_moved_adapter(str(tmp_path))
    cols = collate(batch(gemma, pad_id, 1.0), pad_id, 0, eos_ids=EOS_IDS)
    with torch.no_grad():
        assert torch.equal(chunked_completion_logp(gemma, cols, 1.0, 4)[0],
                           completion_logp(gemma, cols, 1.0)[0])

    model, pad_id = models["qwen2, untied"]
    trained_head = copy.deepcopy(model)
    head = trained_head.get_base_model().get_output_embeddings()
    head.weight.requires_grad_(True)
    cols = collate(batch(trained_head, pad_id, 1.0), pad_id, 0, eos_ids=EOS_IDS)
    logp, _ = chunked_completion_logp(trained_head, cols, 1.0, 4)
    assert torch.equal(logp, completion_logp(trained_head, cols, 1.0)[0])
    logp.sum().backward()
    assert head.weight.grad is not None and head.weight.grad.abs().max() > 0


def test_a_chunk_below_one_token_and_another_temperature_are_refused(models):
    model, pad_id = models["tiny llama, tied"]
    cols = collate(batch(model, pad_id, 0.7), pad_id, 0, eos_ids=EOS_IDS)
    with pytest.raises(ValueError, match="chunk must be at least 1 token, got 0"):
        chunked_completion_logp(model, cols, 0.7, 0)
    with pytest.raises(ValueError, match="temperature 0.7 but log pi_theta is taken at 1"):
        chunked_completion_logp(model, cols, 1.0)
    from infra.engineered_update import _HeadLogp    # copied alone, it refuses a head it would not train
    with pytest.raises(ValueError, match="gives the lm_head no gradient"):
        _HeadLogp.apply(torch.randn(3, 4), torch.randn(5, 4, requires_grad=True), None,
                        torch.tensor([0, 1, 2]), 1.0, 2)


def test_the_default_chunks_only_a_large_vocabulary(models, tmp_path):
    """--logp-chunk -1 (the default): the demo's 50-token vocabulary runs completion_logp itself
    (logp_fn None: the function a reader studies), a vocabulary of 32,000 tokens is chunked by 256,
    one of 31,999 is not; a chunk given, or 0, is kept as it is. The run's config says which."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import train
    assert train.Config().logp_chunk == -1
    demo, _ = models["tiny llama, tied"]
    resolve = engineered_update.resolve_logp_chunk
    assert resolve(-1, demo) == 0 and engineered_update.logp_fn(resolve(-1, demo)) is None
    for vocab, chunk in ((32_000, 256), (31_999, 0)):
        big = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=8,
                                           num_hidden_layers=1, num_attention_heads=2))
        assert resolve(-1, big) == chunk
    assert resolve(64, demo) == 64 and resolve(0, big) == 0
    assert "must be -1" in train.cli.config_problem(train.Config(logp_chunk=-2))
