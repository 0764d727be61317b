"""benchmarks/memory_estimate.py: the estimate against the H200 measurements, hand-checkable properties of
its formula, and its byte counts against what autograd really keeps (a small model on CPU)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import memory_estimate as me  # noqa: E402
from chunked_logp import LiveBytes, random_batch, random_qwen2, update_live_peak  # noqa: E402

GB = 2**30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Measured on a lent NVIDIA H200, 2026-11-30, torch 2.11 / transformers 5.17 / peft 0.21 / bitsandbytes 0.50.2
# (bash benchmarks/gpu_check.sh): models with Qwen2.5-0.5B's shapes (untied lm_head) and Qwen2.5-1.5B's (tied),
# random weights, 152k vocabulary, GSM8K-format prompts of 224-237 tokens, 8 prompts x 8 generations = 64
# rollouts per round, B = N = 128, LoRA r = 16 on all linear layers; peak allocated and reserved GB (2^30 bytes).
MEASURED_MODELS = {"0.5B-shaped, untied": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                               num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                               tie_word_embeddings=False, model_type="qwen2"),
                   "Qwen2.5-1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                        tie_word_embeddings=True, model_type="qwen2")}
MEASURED = [   # model, weights, max new tokens, micro-batch, gradient checkpointing, peak allocated, reserved GB
    ("0.5B-shaped, untied", "bf16", 256, 8, False, 14.73, 15.64),
    ("0.5B-shaped, untied", "4-bit", 256, 2, True, 2.91, 5.23),
    ("0.5B-shaped, untied", "bf16", 512, 2, True, 4.29, 6.47),
    ("Qwen2.5-1.5B", "4-bit", 256, 2, True, 4.81, 7.62),
    ("Qwen2.5-1.5B", "4-bit", 512, 2, True, 4.86, 11.30),
]
Q05 = me.QWEN["Qwen2.5-0.5B"]


def est(c=Q05, *, q4=False, new=256, micro=8, ckpt=False, prompt=231, rollouts=64, padded=True,
        chunk=0):
    """The estimate; chunk 0: the plain log-probs, as the H200 rows were measured."""
    return me.estimate(c, load_in_4bit=q4, rollouts=rollouts, prompt_tokens=prompt,
                       max_new_tokens=new, micro_batch=micro, gradient_checkpointing=ckpt,
                       padded=padded, logp_chunk=chunk)


@pytest.mark.parametrize("model,weights,new,micro,ckpt,measured,reserved", MEASURED)
def test_estimate_within_5_percent_of_the_h200_measurements(model, weights, new, micro, ckpt, measured, reserved):
    e = est(MEASURED_MODELS[model], q4=weights == "4-bit", new=new, micro=micro, ckpt=ckpt, prompt=237)
    assert abs(e["peak"] - measured) / measured <= 0.05, (e["peak"], measured)
    assert e["peak"] == max(e["gen_peak"], e["train_peak"]) and reserved >= measured


def test_the_module_carries_the_same_measurements():
    assert me.MEASURED == MEASURED and me.MEASURED_MODELS == MEASURED_MODELS


def test_logits_term_is_five_fp32_completion_logits_linear_in_micro_batch_and_vocabulary():
    e = est(micro=8, new=256)
    assert e["logits"] == pytest.approx(5 * 8 * 256 * 151936 * 4 / GB)          # 5.80 GB
    assert est(micro=4)["logits"] == pytest.approx(e["logits"] / 2)
    assert est(new=512)["logits"] == pytest.approx(e["logits"] * 2)
    double_vocab = est({**Q05, "vocab_size": 2 * 151936})
    assert double_vocab["logits"] == pytest.approx(2 * e["logits"])
    # the prompt costs activations, not logits
    assert est(prompt=500)["logits"] == e["logits"] and est(prompt=500)["activations"] > e["activations"]


def test_chunked_logits_term_is_two_fp32_chunks_and_two_hidden_states_per_token():
    """train.py's --logp-chunk 256 (its default for Qwen's vocabulary): two fp32 [256, V] tensors,
    whatever the micro-batch, and per scored token its bf16 hidden state and gradient direction."""
    from infra import engineered_update
    assert me.LOGP_CHUNK == engineered_update.LOGP_CHUNK == 256
    V, h = 151936, 896
    e = est(micro=8, new=256, chunk=256)
    assert e["logits"] == pytest.approx((2 * 256 * V * 4 + 2 * 8 * 256 * h * 2) / GB)     # 0.30 GB
    assert e["logits"] < est(micro=8, new=256)["logits"] / 19                           # of 5.80
    assert est(micro=16, chunk=256)["logits"] - e["logits"] == pytest.approx(2 * 8 * 256 * h * 2 / GB)
    # fewer tokens than a chunk: one chunk of them
    assert est(micro=1, new=100, chunk=256)["logits"] == pytest.approx(
        (2 * 100 * V * 4 + 2 * 100 * h * 2) / GB)
    # the saved activations and generation do not change; 4-bit: the fp32 stream and head
    assert e["activations"] == est()["activations"] and e["gen_peak"] == est()["gen_peak"]
    assert est(q4=True, chunk=256)["logits"] == pytest.approx(
        (2 * 256 * V * 4 + 2 * 8 * 256 * h * 4) / GB)


def test_gradient_checkpointing_keeps_only_each_layers_input():
    full, ckpt = est(micro=2, new=512), est(micro=2, new=512, ckpt=True)
    T = 231 + 512 - 1
    assert ckpt["activations"] == pytest.approx(24 * 2 * T * 2 * 896 / GB)    # bf16 layer inputs
    assert full["activations"] == pytest.approx(24 * 2 * T * me.activation_bytes(Q05, load_in_4bit=False,
                                                                                            tokens=T) / GB)
    assert ckpt["activations"] < full["activations"] / 40
    assert ckpt["train_peak"] < full["train_peak"]
    assert ckpt["gen_peak"] == full["gen_peak"]          # generation does not checkpoint


def test_activation_bytes_by_hand():
    h, I, kv, heads, r = 896, 4864, 128, 14, 16
    # bf16: 2 fp32 norm inputs, sdpa q/out/k/v, lse, gate/SiLU/up, 7 fp32 LoRA input copies, LoRA A outputs, rsqrt
    assert me.activation_bytes(Q05, load_in_4bit=False, padded=False) == \
        8 * h + 2 * (2 * h + 2 * kv) + 4 * heads + 6 * I + 4 * (6 * h + I) + 28 * r + 8 == 81920
    assert me.activation_bytes(Q05, load_in_4bit=True, padded=False) == \
        8 * h + 4 * (2 * h + 2 * kv) + 4 * heads + 12 * I + 4 * (2 * h + I) + 28 * r + 8 == 100864
    # padded prompts: K and V repeated to all heads, and the mask bias (T rounded up to 16)
    assert me.activation_bytes(Q05, load_in_4bit=False, tokens=486) == 81920 + 4 * (h - kv) + 2 * 496


def test_generation_peak_grows_with_rollouts_and_length_and_4bit_weights_are_smaller():
    base = est()
    assert est(rollouts=128)["gen_peak"] > base["gen_peak"]
    assert est(new=1024)["decode"] > base["decode"]
    kv_cache = 2 * 24 * 128 * 2 * 64 * (231 + 256) / GB                 # bf16 KV cache of 64 full rollouts
    assert base["decode"] == pytest.approx(kv_cache + 6 * 4 * 64 * 151936 / GB)
    linear, other = 357_826_560, 136_206_208         # Qwen2.5-0.5B: 494M parameters, 136M of them the embedding
    assert base["weights"] == pytest.approx((linear + other) * 2 / GB)
    # 4-bit: nf4 linear layers, and the rest upcast to fp32 by peft's prepare_model_for_kbit_training
    assert est(q4=True)["weights"] == pytest.approx((linear * (0.5 + 1 / 64 + 1 / 4096) + other * 4) / GB)
    assert est({**Q05, "tie_word_embeddings": False})["weights"] == pytest.approx(base["weights"] + 151936 * 896 * 2 / GB)


def test_float16_is_bf16_to_the_estimate(capsys):
    """train.py --dtype float16: 2-byte weights and activations, the same fp32 tensors as bf16."""
    for settings in (dict(), dict(ckpt=True, micro=2, new=512), dict(q4=True)):
        bf16 = est(**settings)
        assert me.estimate(Q05, load_in_4bit=settings.get("q4", False), rollouts=64, prompt_tokens=231,
                           max_new_tokens=settings.get("new", 256), micro_batch=settings.get("micro", 8),
                           gradient_checkpointing=settings.get("ckpt", False), dtype="float16",
                           logp_chunk=0) == bf16
    one = ["--dtype", "float16", "--max-new-tokens", "256", "--micro-batch-size", "8"]
    me.main(one)
    chunked = est(chunk=256)["peak"]
    assert f"ESTIMATE Qwen2.5-0.5B (fp16): peak {chunked:.2f} GB" in capsys.readouterr().out
    me.main(one + ["--logp-chunk", "0"])
    assert f"ESTIMATE Qwen2.5-0.5B (fp16): peak {est()['peak']:.2f} GB" in capsys.readouterr().out
    me.main(["--dtype", "float16"])
    assert "| Qwen2.5-0.5B | fp16 | 512 | 2 | yes |" in capsys.readouterr().out


def test_docs_tables_are_the_measurements_and_this_estimate():
    """docs/gpu.md: the measured rows (allocated, with reserved in brackets) and the estimated
    table, with train.py's default chunked log-probs and, last, the plain ones (--logp-chunk 0)."""
    text = open(os.path.join(ROOT, "docs", "gpu.md")).read()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[3].strip().isdigit()]
    measured = {(r[0], r[1], int(r[2]), int(r[3]), r[4] == "yes", r[5]) for r in rows if "(" in r[5]}
    assert measured == {(m, w, new, micro, ckpt, f"{gb:.2f} ({res:.2f})")
                        for m, w, new, micro, ckpt, gb, res in MEASURED}
    estimated = [r for r in rows if "(" not in r[5]]
    assert len(estimated) == len(me.README_ROWS)
    for cells, (model, w, new, micro, ckpt) in zip(estimated, me.README_ROWS):
        assert cells[:5] == [model, w, str(new), str(micro), "yes" if ckpt else "no"]
        e, plain = (me.estimate(me.QWEN[model], load_in_4bit=w == "4-bit", rollouts=64,
                                prompt_tokens=231, max_new_tokens=new, micro_batch=micro,
                                gradient_checkpointing=ckpt, logp_chunk=chunk)
                    for chunk in (me.LOGP_CHUNK, 0))
        assert cells[5] == f"{e['peak']:.1f}" and cells[7] == me.fits(e["peak"])
        assert cells[8] == f"{plain['peak']:.1f}, {me.fits(plain['peak'])}"


def test_fits_adds_the_measured_context_and_a_reserve():
    assert me.fits(4.8) == "6 GB" and me.fits(4.9) == "8 GB" and me.fits(16.1) == "24 GB"


# ---- the counts against autograd, on CPU with a small Qwen2 (same dtypes and code path as on a GPU) ---------
SMALL = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, tie_word_embeddings=True, model_type="qwen2")


def char_tokenizer():
    from infra.demo_model import char_tokenizer as make
    return make()


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    """{layers: folder} of random Qwen2 models of SMALL's shapes, 1 and 2 layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tokenizer = char_tokenizer()
    folders = {}
    for layers in (1, 2):
        config = Qwen2Config(vocab_size=4096, num_hidden_layers=layers, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                             **{k: v for k, v in SMALL.items() if k != "model_type"})
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(f"small{layers}")
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[layers] = str(folder)
    return folders


def batch_of(m: int, prompt: int, completion: int, padded: bool):
    from buffer import Rollout, collate
    g = torch.Generator().manual_seed(0)
    rollouts = [Rollout(prompt_ids=torch.randint(2, 40, (prompt - (i if padded else 0),), generator=g),
                        completion_ids=torch.randint(2, 40, (completion,), generator=g),
                        behaviour_logp=torch.zeros(completion), reward=0.0, advantage=1.0, policy_version=0,
                        baseline=0.0, temperature=1.0) for i in range(m)]
    return collate(rollouts, 0, 0, eos_ids=[1])      # the character tokenizer's EOS: none drawn


def saved_bytes(folder: str, batch, load_in_4bit: bool) -> int:
    """Bytes of the distinct storages autograd saves in completion_logp's forward, but for the logits."""
    from replay_rl import completion_logp
    from infra.policy import load_policy
    model, _ = load_policy(folder, lora_r=16, dtype=torch.bfloat16, load_in_4bit=load_in_4bit)
    model.train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights and t.shape[-1:] != (4096,):
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_logp(model, batch)
    return sum(seen.values())


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_activation_bytes_are_what_autograd_keeps(small_models, padded, load_in_4bit):
    if load_in_4bit:
        pytest.importorskip("bitsandbytes")
    m, prompt, completion = 2, 41, 24            # T = 64, a multiple of 16: the CPU mask bias is not padded
    batch = batch_of(m, prompt, completion, padded)
    T = batch["input_ids"].shape[1] - 1
    per_layer = saved_bytes(small_models[2], batch, load_in_4bit) - saved_bytes(small_models[1], batch, load_in_4bit)
    config = {**SMALL, "vocab_size": 4096, "num_hidden_layers": 2}
    assert per_layer == m * T * me.activation_bytes(config, load_in_4bit=load_in_4bit, padded=padded, tokens=T)


def test_five_fp32_logits_are_alive_at_the_backward_peak(small_models):
    from replay_rl import completion_logp, policy_loss
    from infra.policy import load_policy
    model, _ = load_policy(small_models[1], lora_r=16, dtype=torch.bfloat16)
    model.train()
    m, prompt, completion, V = 2, 9, 32, 4096
    batch = batch_of(m, prompt, completion, padded=False)
    T = prompt + completion - 1
    activations = m * T * me.activation_bytes({**SMALL, "vocab_size": V, "num_hidden_layers": 1},
                                              load_in_4bit=False, padded=False)
    logits = m * completion * V * 4
    tracker = LiveBytes([p.untyped_storage().data_ptr() for p in model.parameters()])
    with tracker:
        logp, _ = completion_logp(model, batch)
        loss, _ = policy_loss(logp, batch["behaviour_logp"], batch["advantage"], batch["completion_mask"])
        loss.backward()
    copies = (tracker.peak - activations) / logits
    assert me.LOGIT_COPIES - 0.1 < copies < me.LOGIT_COPIES + 0.15, copies     # 5.01: plus a few small tensors


def test_two_fp32_chunk_logits_are_alive_at_the_chunked_peak(small_models):
    """The chunked log-probs' peak over the saved activations is the estimate's logits term: two
    fp32 [chunk, V] tensors and two [tokens, h] ones (bf16 here)."""
    from infra.policy import load_policy
    model, _ = load_policy(small_models[1], lora_r=16, dtype=torch.bfloat16)
    model.train()
    m, prompt, completion, V, h, chunk = 2, 9, 32, 4096, SMALL["hidden_size"], 16
    batch = batch_of(m, prompt, completion, padded=False)
    activations = m * (prompt + completion - 1) * me.activation_bytes(
        {**SMALL, "vocab_size": V, "num_hidden_layers": 1}, load_in_4bit=False, padded=False)
    term = me.CHUNK_LOGIT_COPIES * chunk * V * 4 + 2 * m * completion * h * 2
    ratio = (update_live_peak(model, batch, chunk) - activations) / term
    assert 0.97 < ratio < 1.1, ratio                # 1.03: plus a few small tensors


def test_chunked_update_peaks_below_a_quarter_of_the_plain_one_at_qwen_vocabulary(tmp_path):
    """Issue 44's bound, at Qwen2.5's vocabulary (151,936) with hidden size 16 (the logits
    dominate): micro-batch 8 x 32 completion tokens in chunks of 32, as 8 x 256 in train.py's
    chunks of 256 (that full size: benchmarks/chunked_logp.py --parts live, in
    docs/results/chunked_logp_cpu.json). Live-tensor bytes."""
    from infra.policy import load_policy
    vocab = 151_936
    model, _ = load_policy(random_qwen2(str(tmp_path), vocab, 16), lora_r=16, dtype=torch.bfloat16)
    model.train()
    batch = random_batch(8, 32, 32, vocab)
    plain, chunked = (update_live_peak(model, batch, chunk) for chunk in (0, 32))
    assert chunked <= 0.25 * plain, chunked / plain                  # 0.05
    # five fp32 [256, V] logits at the plain peak; two fp32 [32, V] ones at the chunked peak
    assert 4.9 < plain / (8 * 32 * vocab * 4) < 5.2 and 1.9 < chunked / (32 * vocab * 4) < 2.2
