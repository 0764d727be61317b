"""Peak GPU memory of one round of train.py: generation and training, estimated from the model's shapes.

    python benchmarks/memory_estimate.py                   # measured vs estimated, then the README table
    python benchmarks/memory_estimate.py --model PATH      # the same settings for a local model folder (config.json)
    python benchmarks/memory_estimate.py --model PATH --max-new-tokens 256 --micro-batch-size 8 [--load-in-4bit]
        [--gradient-checkpointing] [--prompt-tokens 231] [--rollouts 64]   # one configuration, term by term
    python benchmarks/memory_estimate.py --dtype float16   # train.py --dtype float16: the same figures as bf16
    python benchmarks/memory_estimate.py --logp-chunk 0    # the plain log-probs (train.py's flag)

GB here is 2^30 bytes, as train.py's gen_peak_mem_gb / train_peak_mem_gb (torch.cuda.max_memory_allocated).
The estimate is of the peak ALLOCATED memory; the GPU also needs the CUDA context and the allocator's
reserve on top (see `fits`). Llama/Qwen2-style decoders (RMSNorm, GQA attention with sdpa, SwiGLU MLP),
LoRA on all linear layers, weights in bf16 or 4-bit (nf4 + double quantization). float16 (train.py --dtype
float16, for GPUs without bf16) is bf16 to this estimate: 2 bytes a weight or activation, and the same tensors
kept in fp32 (the LoRA weights and their inputs, the norms' inputs, the logits).

    peak       = max(gen_peak, train_peak)
    gen_peak   = weights + lora + workspace + max(prefill, decode)
    train_peak = weights + lora + workspace + activations + max(logits, recompute)

with s = bytes of the residual stream: 2 in bf16, 4 with --load-in-4bit (peft's prepare_model_for_kbit_training
upcasts every weight it does not quantize to fp32, the embedding too, so the hidden states are fp32), R rollouts
per round, P the longest prompt of the round (prompts are left-padded to it), C = max new tokens (the worst case,
every completion runs to the limit; training pads to the longest completion of a micro-batch), m the micro-batch,
T = P + C - 1 the tokens of a training forward, h hidden (also heads * head dim: the same in these models),
I intermediate, kv = kv heads * head dim, V vocabulary:

  weights      bf16: 2 bytes per parameter. 4-bit: 0.5 + 1/64 + 1/4096 bytes per linear-layer parameter (nf4,
               8-bit block scales, their fp32 scales), 4 bytes for the embedding, an untied lm_head, norms, biases
  lora         16 bytes per LoRA parameter, r * (in + out) per linear layer: fp32 weight, gradient, 2 AdamW moments
  workspace    32 MiB: the cuBLAS workspace, allocated through torch's caching allocator
  kv(n)        2 * layers * kv * s bytes per token: the KV cache of n tokens
  prefill      kv(R * P) + R * P * ((2s + 8) * I + 2s * h): the first generate() step runs the MLP of one layer over
               all R * P prompt tokens at once; alive at its peak (in the up projection): the SiLU output, the base
               projection's output (s) and the fp32 LoRA branch and sum (8), and the residual and normed states
  decode       kv(R * (P + C)) + 6 * 4 * R * V: the full KV cache, and fp32 [R, V] tensors of a sampling step
               (logits copy, / temperature, log_softmax and its exp in generation.BehaviourLogProbs, the previous
               step's log-probs it keeps, the sampling softmax)
  activations  what autograd saves in the training forward, summed over the layers:
               without checkpointing   layers * m * T * a
               with checkpointing      layers * m * T * s * h (each layer's input)
               a = bytes per token per layer,
                 bf16:  8h (the fp32 input of the two RMSNorms) + 2 * (2h + 2kv') (sdpa's q, out, k, v)
                        + 4 * heads (its logsumexp) + 6I (gate, SiLU and up outputs)
                        + 4 * (6h + I) (peft casts the input of each of the 7 LoRA layers to fp32: 7 copies)
                        + 7 * 4r (the LoRA A outputs) + 8 (the norms' rsqrt) + 2 * T16 (mask bias)
                 4-bit: 8h + 4 * (2h + 2kv') + 4 * heads + 12I + 4 * (2h + I) (the stream is fp32 already: no
                        copies, the LoRA inputs are the two normed states and the down projection's input)
                        + 7 * 4r + 8 + 4 * T16
               kv' = h when prompts are padded (transformers repeats the K/V heads for sdpa under a mask), else kv;
               T16 = T rounded up to 16: the float attention-mask bias sdpa keeps per layer (padded prompts only).
               These byte counts are exact on CPU (torch 2.13, transformers 5.24, peft 0.21: counted with
               saved_tensors_hooks; tests/test_memory_estimate.py checks them on a small model).
               Qwen2.5-0.5B, bf16, padded, T = 486: a = 85,984 bytes.
  recompute    with checkpointing only, later in the backward, once the logits are freed: one layer recomputed,
               2 * m * T * a (its activations and, assumed, as much again for their gradients)
  logits       the log-probs' logits, by train.py's --logp-chunk c (LOGP_CHUNK = 256 by default):
               c > 0 (engineered_update.chunked_completion_logp):
                 2 * min(c, m * C) * V * 4 + 2 * m * C * h * s
                 two fp32 [c, V] tensors of one chunk alive at once (the scaled logits and their
                 softmax; in bf16 the softmax's bf16 copy follows the logits), plus the hidden
                 states of the m * C scored tokens and their gradient directions ([m * C, h] each);
                 nothing of [m, C, V] is kept for the backward. Without checkpointing the
                 backward's own temporaries (on CPU ~0.3 of one layer's activations) stay below the
                 chunk at these shapes and are not modelled.
               c = 0 (replay_rl.completion_logp): 5 * m * C * V * 4: fp32 logits of the completion
                 columns; at the backward peak 5 are alive: the saved scaled logits, gather's
                 gradient, and the three temporaries of logsumexp's backward (logits - lse, its
                 exp, grad * exp). The forward holds fewer (bf16 and fp32 logits, the softmax).
               Both checked on CPU with a live-tensor count (tests/test_memory_estimate.py).

Constants: LOGIT_COPIES = 5, CHUNK_LOGIT_COPIES = 2, the 16 LoRA bytes, the 6 [R, V] tensors and
the workspace are read off the code; nothing is fitted. Against the five rows measured on an H200
(MEASURED below, all with the plain log-probs, c = 0) the estimate is within 2%. The figures of
the chunked log-probs are estimates until a GPU measures them (GPU_CHECK_ROWS="6 7 8 9" bash
benchmarks/gpu_check.sh).
(An earlier version fitted a factor of 1.20 on the saved activations to a measurement of 16.1 GB for the first
row, taken with older code; measured again on 2026-11-30 it is 14.73 GB, which the plain count gives.)
Not modelled: the allocator's reserve beyond the allocated peak (train.py logs gen_reserved_gb /
train_reserved_gb; on the H200, with no memory pressure, it reserved 6% to 133% more than it allocated), the
KV cache's copy while it grows by one token (one layer at a time), LoRA gradients and AdamW moments before the
first update (the steady state is assumed: +8 bytes per LoRA parameter).
"""
from __future__ import annotations

import argparse
import json
import os

GB = 2**30
LOGIT_COPIES = 5             # fp32 [m, C, V] tensors alive at the backward peak (read off the code)
LOGP_CHUNK = 256             # tokens per chunk: train.py's --logp-chunk default (replay_rl's)
CHUNK_LOGIT_COPIES = 2       # fp32 [chunk, V] tensors alive at once in the chunked log-probs
SAMPLING_COPIES = 6          # fp32 [R, V] tensors of one sampling step
LORA_BYTES = 16              # fp32 weight + gradient + 2 AdamW moments
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)     # nf4 + 8-bit absmax per 64 + fp32 absmax per 256 blocks
WORKSPACE = 32 * 2**20       # cuBLAS workspace
DTYPE_BYTES = {"bfloat16": 2, "float16": 2}   # train.py's --dtype of the base weights (without 4-bit)

QWEN = {   # Qwen2.5 shapes (the hub's config.json): hidden, layers, heads, kv heads, intermediate, vocab, tying
    "Qwen2.5-0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2"),
    "Qwen2.5-1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2"),
    "Qwen2.5-3B": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2"),
}

# Measured on a lent NVIDIA H200 on 2026-11-30 (torch 2.11, transformers 5.17, peft 0.21, bitsandbytes 0.50.2;
# `bash benchmarks/gpu_check.sh`): models with Qwen2.5-0.5B's shapes (untied lm_head, Qwen2Config's default) and
# Qwen2.5-1.5B's (tied, as the hub's) and random weights, GSM8K-format prompts of 224-237 tokens, 8 prompts x 8
# generations = 64 rollouts per round, B = N = 128, LoRA r = 16 on all linear layers, every completion running to
# the limit; peak allocated and reserved memory over a round (train.py's metrics, GB = 2^30 bytes).
MEASURED_MODELS = {"0.5B-shaped, untied": {**QWEN["Qwen2.5-0.5B"], "tie_word_embeddings": False},
                   "Qwen2.5-1.5B": QWEN["Qwen2.5-1.5B"]}
MEASURED_SETTINGS = dict(rollouts=64, prompt_tokens=237)
MEASURED = [   # (model, weights, max new tokens, micro-batch, gradient checkpointing, peak allocated, reserved GB)
    ("0.5B-shaped, untied", "bf16", 256, 8, False, 14.73, 15.64),
    ("0.5B-shaped, untied", "4-bit", 256, 2, True, 2.91, 5.23),
    ("0.5B-shaped, untied", "bf16", 512, 2, True, 4.29, 6.47),
    ("Qwen2.5-1.5B", "4-bit", 256, 2, True, 4.81, 7.62),
    ("Qwen2.5-1.5B", "4-bit", 512, 2, True, 4.86, 11.30),
]
CUDA_CONTEXT_GB = 0.67       # measured there: GPU memory in use beyond what torch reserved (context, libraries)
README_ROWS = [   # (model, weights, max new tokens, micro-batch, gradient checkpointing): docs/gpu.md's table
    ("Qwen2.5-0.5B", "bf16", 256, 8, False),
    ("Qwen2.5-0.5B", "bf16", 256, 4, True),     # the README's GSM8K command
    ("Qwen2.5-0.5B", "4-bit", 256, 4, True),
    ("Qwen2.5-0.5B", "bf16", 512, 2, True),
    ("Qwen2.5-0.5B", "bf16", 256, 8, True),
    ("Qwen2.5-0.5B", "bf16", 256, 16, True),
    ("Qwen2.5-0.5B", "bf16", 512, 16, True),
    ("Qwen2.5-1.5B", "bf16", 256, 2, True),
    ("Qwen2.5-1.5B", "bf16", 256, 8, True),
    ("Qwen2.5-1.5B", "bf16", 256, 16, True),
    ("Qwen2.5-1.5B", "4-bit", 256, 2, True),
    ("Qwen2.5-1.5B", "4-bit", 512, 2, True),
    ("Qwen2.5-1.5B", "4-bit", 256, 8, True),
    ("Qwen2.5-1.5B", "4-bit", 256, 16, True),
    ("Qwen2.5-3B", "bf16", 256, 2, True),
    ("Qwen2.5-3B", "bf16", 256, 8, True),
    ("Qwen2.5-3B", "bf16", 256, 16, True),
    ("Qwen2.5-3B", "4-bit", 256, 2, True),
    ("Qwen2.5-3B", "4-bit", 512, 2, True),
    ("Qwen2.5-3B", "4-bit", 256, 8, True),
    ("Qwen2.5-3B", "4-bit", 256, 16, True),
]


def shapes(c: dict) -> dict:
    """The sizes the formula needs, from a config.json dict."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    return dict(h=h, layers=c["num_hidden_layers"], heads=heads, q=heads * head_dim,
                kv=c.get("num_key_value_heads", heads) * head_dim, inter=c["intermediate_size"], V=c["vocab_size"],
                tied=bool(c.get("tie_word_embeddings", False)),
                qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")))


def activation_bytes(c: dict, *, load_in_4bit: bool, lora_r: int = 16, padded: bool = True, tokens: int = 0,
                     dtype: str = "bfloat16") -> int:
    """a: bytes autograd saves per token per layer in the training forward, without checkpointing.
    tokens: the forward's length T (the attention-mask bias of padded prompts grows with it)."""
    d = shapes(c)
    h, q, I = d["h"], d["q"], d["inter"]
    kv = q if padded else d["kv"]                   # repeat_kv under a mask: K and V at the full head count
    s = 4 if load_in_4bit else DTYPE_BYTES[dtype]
    a = 8 * h + s * (2 * q + 2 * kv) + 4 * d["heads"] + 3 * s * I + 7 * 4 * lora_r + 8
    # the inputs the LoRA A matmuls keep, in fp32: 7 copies in bf16; the fp32 stream's own tensors in 4-bit
    a += 4 * (5 * h + q + I) if not load_in_4bit else 4 * (2 * h + I)
    if padded:
        a += s * (-(-tokens // 16) * 16)
    return a


def estimate(c: dict, *, load_in_4bit: bool, rollouts: int, prompt_tokens: int, max_new_tokens: int,
             micro_batch: int, lora_r: int = 16, gradient_checkpointing: bool = False, padded: bool = True,
             dtype: str = "bfloat16", logp_chunk: int = LOGP_CHUNK) -> dict:
    """Every term of the formula (module docstring) in GB, and gen_peak, train_peak, peak.
    prompt_tokens: the longest prompt of a round (the others are padded to it). dtype: of the base
    weights without 4-bit, "bfloat16" or "float16" (DTYPE_BYTES). logp_chunk: train.py's
    --logp-chunk (0: the plain log-probs, as in the measured rows)."""
    d = shapes(c)
    h, q, kv, I, V, n = d["h"], d["q"], d["kv"], d["inter"], d["V"], d["layers"]
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, I), (h, I), (I, h)]     # q, k, v, o, gate, up, down
    linear_params = n * sum(i * o for i, o in linears)
    other_params = V * h * (1 if d["tied"] else 2) + 2 * n * h + h + (n * (q + 2 * kv) if d["qkv_bias"] else 0)
    s = 4 if load_in_4bit else DTYPE_BYTES[dtype]
    weights = linear_params * NF4_BYTES + other_params * 4 if load_in_4bit else (linear_params + other_params) * s
    lora = n * sum(lora_r * (i + o) for i, o in linears) * LORA_BYTES
    R, P, C, m = rollouts, prompt_tokens, max_new_tokens, micro_batch
    kv_per_token = 2 * n * kv * s
    prefill = kv_per_token * R * P + R * P * ((2 * s + 8) * I + 2 * s * h)
    decode = kv_per_token * R * (P + C) + SAMPLING_COPIES * 4 * R * V
    T = P + C - 1
    a = activation_bytes(c, load_in_4bit=load_in_4bit, lora_r=lora_r, padded=padded, tokens=T, dtype=dtype)
    saved = n * m * T * (s * h if gradient_checkpointing else a)     # at the logits' backward
    recompute = 2 * m * T * a if gradient_checkpointing else 0          # later: one layer recomputed
    if logp_chunk:      # one chunk's [c, V] at a time; the tokens' hidden states, gradient directions
        logits = CHUNK_LOGIT_COPIES * min(logp_chunk, m * C) * V * 4 + 2 * m * C * h * s
    else:
        logits = LOGIT_COPIES * m * C * V * 4
    fixed = weights + lora + WORKSPACE
    terms = dict(weights=weights, lora=lora, workspace=WORKSPACE, prefill=prefill, decode=decode,
                 activations=saved, logits=logits, recompute=recompute)
    terms = {k: v / GB for k, v in terms.items()}
    terms["gen_peak"] = (fixed + max(prefill, decode)) / GB
    terms["train_peak"] = (fixed + saved + max(logits, recompute)) / GB
    terms["peak"] = max(terms["gen_peak"], terms["train_peak"])
    return terms


def estimate_gb(c: dict, **kwargs) -> float:
    """The estimated peak (GB) of one round."""
    return estimate(c, **kwargs)["peak"]


def fits(gb: float) -> str:
    """The smallest usual GPU for a peak of gb allocated: + the measured CUDA context (0.67 GB) and 10% for the
    allocator's reserve under memory pressure (assumed: without pressure, on the H200, it reserved more, but it
    frees its cached blocks and retries before it reports out of memory)."""
    need = gb * 1.1 + CUDA_CONTEXT_GB
    return next((f"{cap} GB" for cap in (6, 8, 12, 16, 24, 32, 48, 80) if need <= cap), "> 80 GB")


def measured_vs_estimated() -> list[tuple]:
    """[(model, weights, new tokens, micro-batch, ckpt, measured GB, reserved GB, estimate dict)]."""
    return [(name, w, new, micro, ckpt, gb, reserved,
             estimate(MEASURED_MODELS[name], load_in_4bit=w == "4-bit", max_new_tokens=new, micro_batch=micro,
                      gradient_checkpointing=ckpt, logp_chunk=0, **MEASURED_SETTINGS))
            for name, w, new, micro, ckpt, gb, reserved in MEASURED]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local model folder (its config.json); default: Qwen2.5 sizes")
    p.add_argument("--prompt-tokens", type=int, default=231, help="the longest prompt of a round, in tokens")
    p.add_argument("--rollouts", type=int, default=64, help="rollouts per round (prompts x generations)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="with --micro-batch-size: one configuration")
    p.add_argument("--micro-batch-size", type=int, default=0)
    p.add_argument("--load-in-4bit", action="store_true")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES),
                   help="base weights without --load-in-4bit (train.py's --dtype; float16: as bf16)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--unpadded", action="store_true", help="all prompts of a round have the same length")
    p.add_argument("--logp-chunk", type=int, default=LOGP_CHUNK,
                   help="train.py's --logp-chunk: tokens per chunk of log-probs; 0: the plain ones")
    args = p.parse_args(argv)
    models = QWEN
    if args.model:
        with open(os.path.join(args.model, "config.json")) as f:
            models = {os.path.basename(args.model.rstrip("/")): json.load(f)}
    common = dict(rollouts=args.rollouts, prompt_tokens=args.prompt_tokens, lora_r=args.lora_r,
                  padded=not args.unpadded, dtype=args.dtype, logp_chunk=args.logp_chunk)
    half = {"bfloat16": "bf16", "float16": "fp16"}[args.dtype]     # the label of the 2-byte rows
    if args.max_new_tokens and args.micro_batch_size:
        for name, c in models.items():
            e = estimate(c, load_in_4bit=args.load_in_4bit, max_new_tokens=args.max_new_tokens,
                         micro_batch=args.micro_batch_size, gradient_checkpointing=args.gradient_checkpointing,
                         **common)
            print(f"ESTIMATE {name} ({'4-bit' if args.load_in_4bit else half}): peak {e['peak']:.2f} GB = max(gen {e['gen_peak']:.2f}, train {e['train_peak']:.2f}); "
                  + ", ".join(f"{k} {e[k]:.2f}" for k in ("weights", "lora", "workspace", "prefill", "decode",
                                                          "activations", "logits", "recompute")))
        return
    if not args.model:
        print("MEASURED (H200, 2026-11-30, torch 2.11 / transformers 5.17 / peft 0.21 / bitsandbytes 0.50.2; random "
              "weights) vs this estimate, prompts of up to 237 tokens, 64 rollouts:")
        print("| model | weights | max new tokens | micro-batch | grad. ckpt | measured GB (reserved) | estimate GB "
              "| error | est. gen / train GB |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, w, new, micro, ckpt, gb, reserved, e in measured_vs_estimated():
            error = (e["peak"] - gb) / gb
            print(f"| {name} | {w} | {new} | {micro} | {'yes' if ckpt else 'no'} | {gb:.2f} ({reserved:.2f}) | "
                  f"{e['peak']:.2f} | {f'{error:+.0%}' if abs(error) >= 0.005 else '0%'} | "
                  f"{e['gen_peak']:.1f} / {e['train_peak']:.1f} |")
        print()
    print(f"ESTIMATED peak allocated GPU memory (GB) of one round; LoRA r={args.lora_r} on all linear layers; "
          f"{args.rollouts} rollouts per round; prompts padded to {args.prompt_tokens} tokens; "
          f"log-probs in chunks of {args.logp_chunk} tokens (0: plain), and beside them the plain "
          f"ones (--logp-chunk 0)")
    print("| model | weights | max new tokens | micro-batch | grad. ckpt | est. peak GB "
          "| est. gen / train GB | fits in | plain log-probs: est. peak GB, fits in |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = README_ROWS if not args.model else [(name, *row[1:]) for name in models for row in README_ROWS[:3]]
    for name, w, new, micro, ckpt in rows:
        e, plain = (estimate(models[name], load_in_4bit=w == "4-bit", max_new_tokens=new,
                             micro_batch=micro, gradient_checkpointing=ckpt, **{**common, **chunk})
                    for chunk in ({}, {"logp_chunk": 0}))
        print(f"| {name} | {half if w == 'bf16' else w} | {new} | {micro} | {'yes' if ckpt else 'no'} | "
              f"{e['peak']:.1f} | {e['gen_peak']:.1f} / {e['train_peak']:.1f} | "
              f"{fits(e['peak'])} | {plain['peak']:.1f}, {fits(plain['peak'])} |")


if __name__ == "__main__":
    main()
