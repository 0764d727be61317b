"""Estimated peak GPU memory of one round of train.py, for choosing settings on a laptop GPU.

    python benchmarks/memory_estimate.py                   # the README table (Qwen2.5 0.5B / 1.5B / 3B)
    python benchmarks/memory_estimate.py --model PATH      # any local model folder (reads config.json)

An ESTIMATE from the model's shapes, not a measurement. Peak = base weights + LoRA training state
+ the larger of the generation and training working sets + a fixed CUDA overhead:
  weights     bf16: 2 bytes/param; 4-bit (nf4 + double quantization): 0.53 bytes per linear-layer
              param, embeddings / lm_head and norms stay in bf16
  LoRA        r * (in + out) params per linear layer, fp32 weight + grad + 2 Adam moments = 16 bytes each
  generation  KV cache 2 * layers * kv_heads * head_dim * 2 bytes per token, for R rollouts of
              (prompt + max_new_tokens) tokens; plus ~5 fp32 [R, vocab] tensors per step (logits,
              log-probs, entropy, sampling)
  training    per micro-batch of m rollouts of L tokens: saved activations ~2 bytes * (8*hidden +
              4*intermediate) per token per layer (with --gradient-checkpointing: 2 * hidden per token
              per layer, plus one layer's full set); logits of the C completion tokens in fp32,
              ~3 copies of [m, C, vocab] (logits, softmax, gradient)
  overhead    0.6 GB (CUDA context, allocator slack), then +10%
"""
from __future__ import annotations

import argparse
import json
import os

GB = 2**30
QWEN = {   # Qwen2.5 shapes (config.json): hidden, layers, heads, kv heads, intermediate, vocab
    "Qwen2.5-0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "Qwen2.5-1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936),
    "Qwen2.5-3B": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       intermediate_size=11008, vocab_size=151936),
}


def estimate_gb(c: dict, *, load_in_4bit: bool, rollouts: int, prompt_tokens: int, max_new_tokens: int,
                micro_batch: int, lora_r: int = 16, gradient_checkpointing: bool = False) -> float:
    h, n_layers, V, inter = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    head_dim = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    # linear layers of one block: q, k, v, o, gate, up, down as (in, out)
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    linear_params = n_layers * sum(i * o for i, o in linears)
    other_params = V * h + 2 * n_layers * h        # tied embedding / lm_head, norms
    weights = linear_params * (0.53 if load_in_4bit else 2.0) + other_params * 2.0
    lora = n_layers * sum(lora_r * (i + o) for i, o in linears) * 16
    L = prompt_tokens + max_new_tokens
    generation = 2 * n_layers * kv * 2 * rollouts * L + 5 * rollouts * V * 4
    per_token_layer = 2 * h if gradient_checkpointing else 2 * (8 * h + 4 * inter)
    activations = micro_batch * L * n_layers * per_token_layer
    if gradient_checkpointing:
        activations += micro_batch * L * 2 * (8 * h + 4 * inter)
    training = activations + 3 * micro_batch * max_new_tokens * V * 4
    return ((weights + lora + max(generation, training)) / GB + 0.6) * 1.1


def fits(gb: float) -> str:
    return next((f"{cap} GB" for cap in (6, 8, 12, 16) if gb <= cap * 0.95), "> 16 GB")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local model folder (its config.json); default: Qwen2.5 sizes")
    p.add_argument("--prompt-tokens", type=int, default=200, help="prompt length (GSM8K with a chat template: ~200)")
    args = p.parse_args(argv)
    models = QWEN
    if args.model:
        with open(os.path.join(args.model, "config.json")) as f:
            models = {os.path.basename(args.model.rstrip("/")): json.load(f)}
    print("ESTIMATED peak GPU memory (GB) of one round; LoRA r=16 on all linear layers; "
          f"prompts of {args.prompt_tokens} tokens")
    print("| model | weights | rollouts/round | max new tokens | micro-batch | grad. ckpt | peak GB | fits in |")
    print("|---|---|---|---|---|---|---|---|")
    for name, c in models.items():
        for q in (False, True):
            for rollouts, new, micro, ckpt in ((64, 256, 8, False), (64, 256, 2, True), (64, 512, 2, True)):
                gb = estimate_gb(c, load_in_4bit=q, rollouts=rollouts, prompt_tokens=args.prompt_tokens,
                                 max_new_tokens=new, micro_batch=micro, gradient_checkpointing=ckpt)
                print(f"| {name} | {'4-bit' if q else 'bf16'} | {rollouts} | {new} | {micro} | "
                      f"{'yes' if ckpt else 'no'} | {gb:.1f} | {fits(gb)} |")


if __name__ == "__main__":
    main()
