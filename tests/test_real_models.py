"""Real Hugging Face architectures through ``load_policy``, as a user's ``--model`` folder would be:
tiny random Llama and Qwen2 checkpoints written here (no download), rollouts and LoRA updates,
the saved adapter reloaded with PEFT, and 4-bit (bitsandbytes nf4) on CPU."""
import itertools

import pytest
import torch
from peft import PeftModel
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM)

from infra import demo_model
from buffer import collate
from replay_rl import completion_logp
from infra.policy import load_policy
from infra.engineered_update import update_step_engineered
from rollout import end_token_ids, generate_rollouts

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
PROMPTS = ["1+2=", "33+4=", "9+90="]            # different lengths: left padding in play


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """{architecture: folder} with a random tiny model (~80k parameters) and the character tokenizer,
    saved with save_pretrained exactly as a hub checkpoint is laid out."""
    folders = {}
    for arch, (config_class, model_class) in ARCHITECTURES.items():
        tokenizer = demo_model.char_tokenizer()
        config = config_class(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, **SIZE)
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(arch)
        model_class(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[arch] = str(folder)
    return folders


def chat_model(model_dirs, arch: str, tmp_path):
    """A copy of the tiny model folder whose tokenizer has a (minimal) chat template, as instruct models do."""
    import shutil
    folder = tmp_path / "chat-model"
    shutil.copytree(model_dirs[arch], folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    tokenizer.save_pretrained(folder)
    return folder


def load(folder: str, arch: str, **kwargs):
    # exactly the path of a hub id (load_policy handles the Qwen2 char-vocabulary trap itself)
    return load_policy(folder, lora_r=4, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_load_policy_tokenizer_keeps_spaces(model_dirs, arch):
    _, tokenizer = load_policy(model_dirs[arch], lora_r=4)
    text = "12 + 3 = 15"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rollouts_update_lora_and_adapter_reloads(model_dirs, arch, tmp_path):
    folder = model_dirs[arch]
    torch.manual_seed(0)
    model, tokenizer = load(folder, arch)
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert lora and all("lora_" in n for n in lora)                  # only LoRA trains
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-2)
    counter = itertools.count()
    reward = lambda prompt, completion: float(next(counter) % 3)    # varied rewards: non-zero advantages

    for step in range(2):        # two steps: lora_B starts at 0, so lora_A moves from the second on
        model.eval()
        rollouts, _ = generate_rollouts(model, tokenizer, PROMPTS, reward, num_generations=4, max_new_tokens=6,
                                        policy_version=step)
        eos_ids = end_token_ids(model, tokenizer)[0]
        batch = collate(rollouts, tokenizer.pad_token_id, step, eos_ids=eos_ids)
        with torch.no_grad():
            logp, _ = completion_logp(model, batch)
        # the log-probs recorded while sampling are those of a training forward on this architecture
        assert ((logp - batch["behaviour_logp"]).abs() * batch["completion_mask"]).max() < 1e-4
        model.train()
        update_step_engineered(model, optimizer, rollouts, pad_id=tokenizer.pad_token_id, eos_ids=eos_ids,
                               current_version=step)

    params = dict(model.named_parameters())
    assert all(not torch.equal(params[n], before) for n, before in lora.items())
    assert all(torch.equal(params[n], before) for n, before in frozen.items())

    model.eval()
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter").eval()
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        trained, again = model(**enc).logits, reloaded(**enc).logits
        with reloaded.disable_adapter():
            base = reloaded(**enc).logits
    torch.testing.assert_close(again, trained, rtol=0, atol=1e-6)
    assert (base - trained).abs().max() > 1e-3                     # the adapter is really in the path


def test_4bit_lora_gradients_after_generate(model_dirs):
    """load_in_4bit on CPU: after generate, an update step must give every LoRA weight the same
    gradient as a copy that never generated. (bitsandbytes repacks 4-bit weights for fast CPU
    inference in a no-grad forward; backward through a repacked layer then skips the base weight,
    silently changing every LoRA gradient. load_policy turns the repacking off.)"""
    bnb = pytest.importorskip("bitsandbytes")
    folder = model_dirs["llama"]

    def policy():
        torch.manual_seed(1)
        model, tokenizer = load_policy(folder, lora_r=4, load_in_4bit=True)
        for name, p in model.named_parameters():
            if "lora_B" in name:        # non-zero B, so that lora_A gets a gradient on the first step
                p.data.normal_(0, 0.05)
        return model, tokenizer

    def lora_grads(model, rollouts, tokenizer):
        model.train()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        update_step_engineered(model, optimizer, rollouts, pad_id=tokenizer.pad_token_id,
                               eos_ids=end_token_ids(model, tokenizer)[0], current_version=0)
        return {n: p.grad for n, p in model.named_parameters() if "lora_" in n}

    model, tokenizer = policy()
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 14     # 7 projections x 2 layers
    model.eval()
    counter = itertools.count()
    rollouts, _ = generate_rollouts(model, tokenizer, PROMPTS, lambda p, c: float(next(counter) % 3),
                                    num_generations=4, max_new_tokens=6, policy_version=0)
    grads = lora_grads(model, rollouts, tokenizer)
    assert len(grads) == 28                                                         # A and B of each
    for name, g in grads.items():
        assert g is not None and g.abs().sum() > 0, name

    fresh, _ = policy()
    reference = lora_grads(fresh, rollouts, tokenizer)
    for name, g in grads.items():
        torch.testing.assert_close(g, reference[name], rtol=1e-4, atol=1e-7, msg=name)


def test_train_on_a_local_model_with_a_chat_template_and_a_jsonl_task(model_dirs, tmp_path, monkeypatch):
    """The whole train.py path for a user's model folder: chat template (with a system prompt) on
    the model's side, the plain prompt on the reward's side, a GSM8K-format file as the task."""
    import json
    import sys

    import rollout
    import train

    folder = chat_model(model_dirs, "llama", tmp_path)
    rows = [{"question": f"what is {i} + {i}", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(20)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    # a custom reward that records the prompts it is given
    (tmp_path / "spyreward.py").write_text("SEEN = []\ndef reward(prompt, completion):\n"
                                           "    SEEN.append(prompt)\n    return float('2' in completion)\n")
    seen_by_model = []
    real_generate = rollout.generate_rollouts

    def spy(model, tok, prompts, reward_fn, **kw):
        seen_by_model.extend(prompts)
        return real_generate(model, tok, prompts, reward_fn, **kw)

    monkeypatch.setattr(rollout, "generate_rollouts", spy)
    result = train.main(["--model", str(folder), "--task", str(tmp_path / "sums.jsonl"), "--system-prompt", "be brief",
                         "--reward", f"{tmp_path / 'spyreward.py'}:reward",
                         "--output-dir", str(tmp_path / "run"), "--max-rounds", "2", "--prompts-per-round", "2",
                         "--num-generations", "4", "--buffer-size", "8", "--batch-size", "8", "--max-new-tokens", "8",
                         # the README's GSM8K command's memory and eval flags, through train.py
                         "--lr", "2e-5", "--micro-batch-size", "4", "--gradient-checkpointing", "--eval-prompts", "2",
                         "--eval-every", "1",
                         # the reward in this process: the spy reads its module's list here
                         "--reward-timeout", "0"])
    assert result["step"] == 2
    assert seen_by_model and all(p.startswith("system: be brief;user: what is ") and p.endswith(";assistant:")
                                 for p in seen_by_model)
    seen_by_reward = sys.modules["reward_spyreward"].SEEN
    assert seen_by_reward and all(p.startswith("what is ") for p in seen_by_reward)   # the plain prompt
    evals = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl") if "eval_accuracy" in l]
    assert {"eval_strict", "eval_lenient"} <= set(evals[0]) and [e["round"] for e in evals] == [0, 1, 2]
    # evaluate.py rebuilds the model, chat template, system prompt, task and reward from the run's
    # config: the figures of the last eval line
    import evaluate
    scores = evaluate.main([str(tmp_path / "run"), "--eval-prompts", "2"])
    names = ("eval_accuracy", "eval_strict", "eval_lenient")
    assert {k: scores[k] for k in names} == {k: evals[-1][k] for k in names}


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_gradient_checkpointing_gives_the_same_lora_gradients(model_dirs, load_in_4bit):
    """--gradient-checkpointing (with and without 4-bit) recomputes activations in backward: same gradient."""
    if load_in_4bit:
        pytest.importorskip("bitsandbytes")
    counter = itertools.count()
    rollouts = None
    grads = {}
    for checkpointing in (False, True):
        torch.manual_seed(1)
        model, tokenizer = load_policy(model_dirs["llama"], lora_r=4, load_in_4bit=load_in_4bit,
                                       gradient_checkpointing=checkpointing)
        for name, p in model.named_parameters():
            if "lora_B" in name:        # non-zero B, so that lora_A gets a gradient too
                p.data.normal_(0, 0.05)
        if rollouts is None:
            model.eval()
            rollouts, _ = generate_rollouts(model, tokenizer, PROMPTS, lambda p, c: float(next(counter) % 3),
                                            num_generations=4, max_new_tokens=6, policy_version=0)
        model.train()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        update_step_engineered(model, optimizer, rollouts, pad_id=tokenizer.pad_token_id,
                               eos_ids=end_token_ids(model, tokenizer)[0], current_version=0, micro_batch_size=4)
        grads[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
    assert len(grads[True]) == 28 and all(g.abs().sum() > 0 for g in grads[True].values())
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_readme_adapter_snippet_runs_and_the_merged_model_answers_alike(model_dirs, tmp_path, capsys):
    """docs/usage.md's 'Use the adapter' code, run as written on a local chat model and a trained
    adapter: it prints a completion, and the merged model it saves gives the same greedy answer."""
    import os
    import re

    import train
    from transformers import AutoModelForCausalLM

    folder = chat_model(model_dirs, "qwen2", tmp_path)
    run = tmp_path / "run"
    train.main(["--model", str(folder), "--task", "addition", "--output-dir", str(run), "--max-rounds", "1",
                "--prompts-per-round", "2", "--num-generations", "4", "--buffer-size", "8", "--batch-size", "8",
                "--eval-prompts", "2", "--no-plot", "--no-progress", "--lr", "0.05"])
    guide = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "usage.md")).read()
    code = re.search(r"```python\n(.*?)```", guide, re.S).group(1)
    assert "PeftModel.from_pretrained" in code and "merge_and_unload" in code
    code = (code.replace("Qwen/Qwen2.5-0.5B-Instruct", str(folder)).replace("runs/RUN/adapter", str(run / "adapter"))
            .replace('"qwen-gsm8k"', repr(str(tmp_path / "merged"))).replace("max_new_tokens=256", "max_new_tokens=12")
            .replace("torch.bfloat16", "torch.float32"))      # float32: merging in bf16 could round an argmax over
    capsys.readouterr()
    exec(compile(code, "docs/usage.md", "exec"), {})      # our own guide's code, not model output
    printed = capsys.readouterr().out
    assert printed.strip()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    exec(compile(code.replace("model = PeftModel.from_pretrained(base,", "model = (lambda *a: merged)(base,")
                 .split("model.merge_and_unload")[0], "docs/usage.md", "exec"), {"merged": merged})
    assert capsys.readouterr().out == printed              # the merged weights answer as base + adapter
