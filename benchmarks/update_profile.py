"""Where update_step_engineered's time goes beyond a bare training step, on one batch, with variants of the
training forward's log-prob pass (the full-vocabulary work is what differs from the bare step).

    python benchmarks/update_profile.py          # on a GPU: a 0.5B-shaped model (bf16), 64 x (231 + 128) tokens
    SMALL=1 python benchmarks/update_profile.py  # a CPU check of the script with tiny shapes

Prints the median ms of each variant over 7 repetitions, its ratio to the bare step, and a
profile (CUDA time by op, host waits) of update_step_engineered and of the bare step. Variants:
  bare           forward, log_softmax + gather, mean loss, backward, AdamW (bench.py's bare step)
  ours           update_step_engineered as it is
  before         update_step_engineered with the earlier completion_logp: logits / T even at T = 1, and the
                 entropy's sum_v p_v z_v as a [B, C, V] product summed
  no_entropy     update_step_engineered without the entropy metric: the floor of what the log-prob pass costs
  collate+copy   building the batch on the host and copying it to the device

Measured on an H200 (2026-11-30, torch 2.11, transformers 5.17, peft 0.21), before this change,
when "ours" was "before": bare 383.5 ms, before 418.2 (1.091), without the division and with the
einsum 411.0 (1.068), no_entropy 401.4 (1.047), collate+copy 2.7 ms; CUDA kernel time 396.9 ms
(update_step_engineered) vs 377.0 (bare): the overhead is mostly GPU work, not host waits.
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the project's modules

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import replay_rl  # noqa: E402
from bench import bare_step  # noqa: E402
from buffer import Rollout, collate  # noqa: E402
from infra.demo_model import char_tokenizer  # noqa: E402
from infra.policy import load_policy  # noqa: E402
from infra.engineered_update import update_step_engineered  # noqa: E402

small = os.environ.get("SMALL") == "1"
dev = "cuda" if torch.cuda.is_available() else "cpu"
cfg = Qwen2Config(hidden_size=64 if small else 896, intermediate_size=128 if small else 4864,
                  num_hidden_layers=2 if small else 24, num_attention_heads=2 if small else 14,
                  num_key_value_heads=2, vocab_size=1000 if small else 151936, pad_token_id=0, eos_token_id=1,
                  bos_token_id=1)
torch.manual_seed(0)
with torch.device(dev):
    base = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
base.save_pretrained("/tmp/update_profile_model")
char_tokenizer().save_pretrained("/tmp/update_profile_model")
del base
model, _ = load_policy("/tmp/update_profile_model", device=dev, dtype=torch.bfloat16)
model.train()
B, P, C = (8, 20, 8) if small else (64, 231, 128)
g = torch.Generator().manual_seed(0)
rollouts = [Rollout(torch.randint(2, cfg.vocab_size, (P,), generator=g),
                    torch.randint(2, cfg.vocab_size, (C,), generator=g), -torch.rand(C, generator=g) * 5,
                    reward=float(i % 2), advantage=float(i % 2) * 2 - 1, policy_version=0, baseline=0.5,
                    temperature=1.0) for i in range(B)]
params = [p for p in model.parameters() if p.requires_grad]
opt, bare_opt = torch.optim.AdamW(params, lr=1e-5), torch.optim.AdamW(params, lr=1e-5)
EOS_IDS = [1]           # cfg's eos_token_id: the random tokens above are drawn from 2 up, none ends
cols = collate(rollouts, 0, device=dev, eos_ids=EOS_IDS)
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)


def bare():
    bare_step(model, bare_opt, cols)


def forward(batch):
    n = batch["completion_mask"].shape[1]
    logits = model(input_ids=batch["input_ids"][:, :-1], attention_mask=batch["attention_mask"][:, :-1],
                   position_ids=batch["position_ids"][:, :-1], logits_to_keep=n).logits
    return logits, batch["input_ids"][:, -n:]


def before(model_, batch, temperature=1.0):
    logits, tokens = forward(batch)
    logits = logits.float() / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, tokens[..., None]).squeeze(-1) - log_z
    with torch.no_grad():
        entropy = log_z - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp, entropy


def no_entropy(model_, batch, temperature=1.0):
    logits, tokens = forward(batch)
    logits = logits.float()
    logp = logits.gather(-1, tokens[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return logp, torch.zeros_like(logp)


def ours(logp_fn=None):
    def step():
        original = replay_rl.completion_logp
        replay_rl.completion_logp = logp_fn or original
        try:
            return update_step_engineered(model, opt, rollouts, pad_id=0, eos_ids=EOS_IDS,
                                          current_version=0)
        finally:
            replay_rl.completion_logp = original
    return step


def timed(fn):
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


fns = {"bare": bare, "ours": ours(), "before": ours(before), "no_entropy": ours(no_entropy),
       "collate+copy": lambda: collate(rollouts, 0, device=dev, eos_ids=EOS_IDS)}
for fn in fns.values():
    fn(), fn()
ms = {k: [] for k in fns}
for _ in range(7):
    for k, fn in fns.items():
        ms[k].append(timed(fn))
print("MEDIAN_MS " + json.dumps({k: round(statistics.median(v), 2) for k, v in ms.items()}))
print("RATIO_TO_BARE " + json.dumps({k: round(statistics.median(a / b for a, b in zip(v, ms["bare"])), 3)
                                     for k, v in ms.items()}))

from torch.profiler import ProfilerActivity, profile  # noqa: E402
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
for name in ("ours", "bare"):
    with profile(activities=activities) as prof:
        fns[name]()
        sync()
    print(f"== profile of {name}")
    print(prof.key_averages().table(sort_by="cuda_time_total" if dev == "cuda" else "cpu_time_total",
                                    row_limit=15, max_name_column_width=60))
    for e in prof.key_averages():
        if any(s in e.key for s in ("Synchronize", "Memcpy", "_local_scalar")):
            print(f"host wait? {e.key}: {e.count} calls, self CPU {e.self_cpu_time_total / 1e3:.2f} ms")
