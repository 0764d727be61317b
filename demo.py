"""The embedded demo model (``--model tiny``): a character tokenizer and a ~0.5M-parameter Llama
built in code, given a short supervised warm start on an embedded task (``tasks.addition_task``)
so that RL starts at a moderate accuracy. It is cached on disk with ``save_pretrained`` and then
loads like any HF model. The algorithm modules know nothing of this file: train.py passes the
folder as the model path.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time

import torch

from tasks import Task

CHARS = "0123456789+-*=()., :;#abcdefghijklmnopqrstuvwxyz"
PAD, EOS = "<pad>", "<eos>"


def char_tokenizer():
    """A character-level tokenizer built in code: one id per character of CHARS, plus pad and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")   # every character alone
    tok.decoder = decoders.Fuse()                                       # join without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left")


TINY_MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=True)
WARM_START = dict(steps=650, batch_size=128, lr=3e-3, warmup=50, betas=(0.9, 0.98), max_grad_norm=1.0, seed=0)


def cache_dir() -> str:
    return os.environ.get("REPLAY_RL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "replay-rl"))


def tiny_model(task: Task, warm_start_steps: int | None = None, log=print) -> str:
    """Folder of the warm-started tiny model for ``task``; built (and cached) on first use.
    Fewer ``warm_start_steps`` than the default give a weaker start: sparser rewards for RL."""
    w = {**WARM_START, "steps": warm_start_steps or WARM_START["steps"]}
    spec = json.dumps({"task": task.name, "chars": CHARS, "model": TINY_MODEL, "warm": w, "v": 1}, sort_keys=True)
    path = os.path.join(cache_dir(), f"tiny-{task.name}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    if task.target is None:
        raise ValueError(f"task {task.name!r} has no supervised targets: the tiny model needs an embedded task")
    log(f"building the tiny model for {task.name} (supervised warm start, cached in {path}) ...")
    start = time.time()
    model, tokenizer = warm_start(task, w["steps"])
    tmp = f"{path}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)          # atomic: a half-written folder is never taken for a cached model
    log(f"warm start done in {time.time() - start:.0f} s")
    return path


def warm_start(task: Task, steps: int | None = None):
    """Supervised training of a fresh tiny Llama on prompt -> target + EOS (loss on the completion).
    Deterministic for a given WARM_START seed. Returns (model, tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    w = {**WARM_START, "steps": steps or WARM_START["steps"]}
    torch.manual_seed(w["seed"])
    rng = random.Random(w["seed"])
    tokenizer = char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, **TINY_MODEL)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=w["lr"], betas=w["betas"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / w["warmup"]) )
    model.train()
    for _ in range(w["steps"]):
        prompts = rng.sample(task.train_prompts, w["batch_size"])
        prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        target_ids = [tokenizer.encode(task.target(p), add_special_tokens=False) + [tokenizer.eos_token_id]
                      for p in prompts]
        L = max(len(p) + len(t) for p, t in zip(prompt_ids, target_ids))
        ids = torch.full((len(prompts), L), tokenizer.pad_token_id)
        labels = torch.full((len(prompts), L), -100)
        for i, (p, t) in enumerate(zip(prompt_ids, target_ids)):
            ids[i, :len(p) + len(t)] = torch.tensor(p + t)
            labels[i, len(p):len(p) + len(t)] = torch.tensor(t)
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), w["max_grad_norm"])
        opt.step()
        sched.step()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer
