"""Checkpoints, exact resume, interruption, and clear failures."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from infra import checkpoint
import train
from infra import policy
import replay_rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The state.json that the code of commit b4e0b95 (its loop state a dict of string keys) wrote at the
# end of round 2 of a SMALL run (--max-rounds 2, --no-progress): the layout of the checkpoints
# people have on disk.
OLD_STATE = os.path.join(ROOT, "tests", "fixtures", "state-b4e0b95.json")
SMALL = ["--prompts-per-round", "4", "--num-generations", "4", "--buffer-size", "32", "--batch-size", "16",
         "--updates-per-round", "2", "--eval-prompts", "50", "--eval-every", "1000", "--seed", "3"]


def step_rows(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rows if "eval_accuracy" not in r]


def test_resume_continues_exactly(tmp_path, tiny_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    train.main(SMALL + ["--output-dir", full, "--max-rounds", "4"])
    train.main(SMALL + ["--output-dir", part, "--max-rounds", "2"])
    assert os.path.isdir(os.path.join(part, "checkpoint-2"))
    train.main(["--resume", part, "--max-rounds", "4"])                  # a larger --max-rounds overrides
    a, b = step_rows(full), step_rows(part)
    assert [r["step"] for r in b] == list(range(1, 9))                    # appended, nothing repeated
    later = [r for r in a if r["round"] > 2]
    assert len(later) == 4
    assert later == [r for r in b if r["round"] > 2]                      # rounds 3-4: the same metrics


def test_loop_state_reads_the_layouts_of_older_checkpoints():
    old = json.load(open(OLD_STATE))
    state = dataclasses.asdict(train.LoopState(**checkpoint.upgraded(old["state"], old["config"])))
    kept = {k: v for k, v in old["state"].items() if k not in checkpoint.RETIRED_FIELDS}
    assert {k: state[k] for k in kept} == kept          # every field read, none renamed
    assert set(old["state"]) & set(checkpoint.RETIRED_FIELDS)     # the mid-round fields: dropped
    # checkpoints from before these fields: zeros, one process
    older = {k: v for k, v in kept.items()
             if k not in ("rollouts_trained", "lapsed_updates", "eval_reward_errors", "world_size")}
    state = train.LoopState(**checkpoint.upgraded(older, old["config"]))
    assert (state.rollouts_trained, state.lapsed_updates, state.eval_reward_errors,
            state.world_size) == (4 * 16, 0, 0, 1)


def test_a_checkpoint_of_a_newer_version_is_named_not_skipped_as_damaged(tmp_path, capsys):
    """Issue 69 (5): a loop-state field this version does not know was 'damaged': the resume went
    back to the older checkpoint and later overwrote the newer one. Now one line names the newer
    version, for --resume of the run folder and of the checkpoint itself, and nothing is removed."""
    old = json.load(open(OLD_STATE))
    for r in (1, 2):
        folder = tmp_path / f"checkpoint-{r}"
        folder.mkdir()
        state = {**old["state"], "round": r} | ({"a_field_of_later": 1} if r == 2 else {})
        (folder / "state.json").write_text(json.dumps({**old, "state": state}))
    for path in (str(tmp_path), str(tmp_path / "checkpoint-2")):
        with pytest.raises(checkpoint.NewerVersion, match="written by a newer version of replay-rl "
                           "\\(its loop state has 'a_field_of_later'"):
            checkpoint.newest_readable(path) if path == str(tmp_path) else checkpoint.read(path)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2"]


def test_a_checkpoint_written_before_the_typed_loop_state_resumes_exactly(tmp_path, tiny_path):
    """The old state.json in place of the one the same checkpoint has now: the run goes on as if
    never interrupted."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    train.main(SMALL + ["--output-dir", full, "--max-rounds", "4"])
    train.main(SMALL + ["--output-dir", part, "--max-rounds", "2"])
    path = os.path.join(part, "checkpoint-2", "state.json")
    now, old = json.load(open(path)), json.load(open(OLD_STATE))
    # The old layout with this run's values where they name this run's files and settings: its
    # folder and metrics.jsonl (timings print with other digits), the demo model's defaults.
    old["config"] = {k: now["config"][k] for k in old["config"]} | {"warm_start_seed": 0}   # (*)
    old["state"]["metrics_bytes"] = now["state"]["metrics_bytes"]
    with open(path, "w") as f:
        json.dump(old, f)
    train.main(["--resume", part, "--max-rounds", "4"])
    # generated tokens count on from the saved figure (the same where the fixture was made)
    shift = old["state"]["gen_tokens"] - now["state"]["gen_tokens"]
    a, b = step_rows(full), step_rows(part)
    assert [r["step"] for r in b] == list(range(1, 9))
    later = [{**r, "gen_tokens": r["gen_tokens"] - shift} for r in b if r["round"] > 2]
    assert len(later) == 4 and later == [r for r in a if r["round"] > 2]


def test_a_checkpoint_of_the_earlier_demo_model_is_refused_in_one_line(tmp_path, tiny_path, capsys):
    """(*) A demo run saved before the two-phase warm start (no warm_start_seed in its config) was
    trained on a base model this code no longer builds: --resume and evaluate.py refuse it."""
    import evaluate
    run = str(tmp_path / "run")
    train.main(SMALL + ["--output-dir", run, "--max-rounds", "1"])
    for name in ("checkpoint-1/state.json", "config.json"):
        saved = json.load(open(os.path.join(run, name)))
        config = saved["config"] if "config" in saved else saved
        del config["warm_start_seed"]
        config["warm_start_steps"] = 650
        json.dump(saved, open(os.path.join(run, name), "w"))
    for call in (lambda: train.main(["--resume", run]), lambda: evaluate.main([run])):
        with pytest.raises(SystemExit) as e:
            call()
        assert e.value.code == 2 and "earlier one-phase warm start" in capsys.readouterr().err


def test_a_resume_reads_each_checkpoint_file_once(tmp_path, tiny_path, monkeypatch):
    import safetensors.torch
    run = str(tmp_path / "run")
    train.main(SMALL + ["--output-dir", run, "--max-rounds", "1"])
    reads, load_file, load = [], safetensors.torch.load_file, torch.load

    def counted(real):
        return lambda path, *a, **k: (reads.append(os.path.relpath(path, run)), real(path, *a, **k))[1]

    monkeypatch.setattr(safetensors.torch, "load_file", counted(load_file))
    monkeypatch.setattr(torch, "load", counted(load))
    train.main(["--resume", run, "--max-rounds", "2"])
    assert sorted(r for r in reads if r.startswith("checkpoint-1")) == [
        os.path.join("checkpoint-1", name) for name in
        ("adapter/adapter_model.safetensors", "buffer.safetensors", "optimizer.pt", "rng.safetensors")]


def test_resume_with_more_processes_than_saved_is_one_line_from_rank_0(tmp_path, tiny_path, capsys,
                                                                       monkeypatch):
    run = str(tmp_path / "run")
    train.main(SMALL + ["--output-dir", run, "--max-rounds", "1"])
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, lines in (("0", 1), ("1", 0)):    # rank 1 has no shard in a 1-process checkpoint
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            train.parse_config(["--resume", run])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == lines       # every rank exits, rank 0 says why
        if lines:
            assert "saved by 1 process(es), resumed with 2" in err[0]


def test_errors_every_rank_reaches_are_printed_by_rank_0_alone(capsys, monkeypatch):
    from infra import distributed
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, printed in (("0", "error: the same on every rank\n"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            distributed.exit_all("error: the same on every rank", 3)
        assert e.value.code == 3 and capsys.readouterr().err == printed


def test_the_resume_hint_is_the_command_that_ran(monkeypatch):
    from infra import distributed
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert distributed.command("train.py --resume runs/a") == "python train.py --resume runs/a"
    monkeypatch.setenv("WORLD_SIZE", "2")           # torchrun refuses a plain python resume of 2 shards
    assert distributed.command("train.py --resume runs/a") == \
        "torchrun --nproc-per-node 2 train.py --resume runs/a"
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert distributed.command("train.py") == "torchrun --nnodes 2 --nproc-per-node 4 train.py"


def test_resume_refuses_changed_fields_and_missing_checkpoints(tmp_path, tiny_path, capsys):
    run = str(tmp_path / "run")
    train.main(SMALL + ["--output-dir", run, "--max-rounds", "1"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.parse_config(["--resume", run, "--lora-r", "8", "--buffer-size", "64"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--lora-r" in err and "--buffer-size" in err and len(err.strip().splitlines()) == 1
    cfg = train.parse_config(["--resume", run, "--lr", "5e-4"])           # fields that may change do
    assert cfg.lr == 5e-4 and cfg.lora_r == 16 and cfg.resume.endswith("checkpoint-1")
    with pytest.raises(SystemExit) as e:
        train.parse_config(["--resume", str(tmp_path / "nowhere")])
    assert e.value.code == 2


def test_a_resumed_run_stays_in_its_folder(saved_run, tmp_path, capsys):
    """--resume RUN --output-dir X went on in RUN without a word about X."""
    with pytest.raises(SystemExit) as e:
        train.parse_config(["--resume", saved_run, "--output-dir", str(tmp_path / "elsewhere")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"--output-dir {tmp_path / 'elsewhere'}" in err[0]
    assert train.parse_config(["--resume", saved_run, "--output-dir", saved_run + "/"]).output_dir == saved_run


def test_warm_start_steps_0_and_2000_name_the_same_model_on_resume(saved_run, capsys):
    """0 is the demo's own warm start, 2000 steps (demo_model.WARM_START): --resume took them for a change."""
    assert train.parse_config(["--resume", saved_run, "--warm-start-steps", "2000"]).warm_start_steps == 0
    with pytest.raises(SystemExit) as e:
        train.parse_config(["--resume", saved_run, "--warm-start-steps", "300"])
    assert e.value.code == 2 and "--warm-start-steps (saved 0, given 300)" in capsys.readouterr().err


@pytest.fixture
def mac_gpu(monkeypatch):
    """torch.mps stood in for (no Mac here): its RNG stream, and what is put back into it."""
    gpu = types.SimpleNamespace(state=torch.arange(16, dtype=torch.uint8), put=[])
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: gpu.state.clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", gpu.put.append)
    return gpu


def test_a_macs_gpu_rng_stream_is_saved_and_put_back(mac_gpu, saved_run):      # mac_gpu first: saved with it
    """Sampling on a Mac's GPU draws from MPS's stream: without it a resume there is not exact."""
    saved = checkpoint.read(os.path.join(saved_run, "checkpoint-1"))
    assert torch.equal(saved.rng["mps"], mac_gpu.state)
    checkpoint.set_rng_states(saved.rng)
    assert len(mac_gpu.put) == 1 and torch.equal(mac_gpu.put[0], mac_gpu.state)


def test_keep_checkpoints_prunes_old_ones(tmp_path, tiny_path):
    run = str(tmp_path / "run")
    train.main(SMALL + ["--output-dir", run, "--max-rounds", "4", "--save-every", "1", "--keep-checkpoints", "2"])
    assert sorted(d for d in os.listdir(run) if d.startswith("checkpoint")) == ["checkpoint-3", "checkpoint-4"]


def run_script(code, env_extra=None, **kw):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
def test_sigint_saves_the_round_under_way_as_it_began_and_resumes(tmp_path, tiny_path):
    run = str(tmp_path / "run")
    proc = run_script(f"import train; train.main({SMALL + ['--output-dir', run, '--max-rounds', '100000']!r})")
    metrics = os.path.join(run, "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 6):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "checkpoint saved" in err and "Traceback" not in err
    found = checkpoint.find(run)
    saved = json.load(open(os.path.join(found, "state.json")))["state"]
    rows = step_rows(run)       # the round cut short may have logged a step: it is done again
    assert saved["step"] <= rows[-1]["step"] <= saved["step"] + 1
    result = train.main(["--resume", run, "--max-rounds", str(saved["round"] + 1)])
    steps = [r["step"] for r in step_rows(run)]
    assert steps == list(range(1, len(steps) + 1)) and result["step"] > saved["step"]


@pytest.mark.slow
def test_sigkill_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path, tiny_path):
    run = str(tmp_path / "run")
    # Die (SIGKILL, no cleanup) in the middle of writing the second checkpoint: after its adapter
    # is written and before its optimizer state is.
    proc = run_script(f"""
        import os, signal, torch, train
        real_save, calls = torch.save, []
        def dying_save(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(*a, **k)
        torch.save = dying_save
        train.main({SMALL + ['--output-dir', run, '--max-rounds', '5', '--save-every', '1']!r})
    """)
    proc.communicate(timeout=180)
    assert proc.returncode == -signal.SIGKILL
    assert os.path.isdir(os.path.join(run, ".tmp-checkpoint-2"))          # the half-written one
    assert checkpoint.find(run).endswith("checkpoint-1")
    result = train.main(["--resume", run, "--max-rounds", "2"])
    assert result["round"] == 2


def test_reward_error_names_prompt_and_completion_or_scores_zero(tmp_path, tiny_path, monkeypatch, capsys):
    import tasks
    real = tasks.load_task

    def flaky_task(name, **kwargs):
        task = real(name, **kwargs)
        good = task.reward
        task.reward = lambda p, c: good(p, c) if len(c) != 2 else 1 / 0      # fails on 2-character answers
        return task

    monkeypatch.setattr(tasks, "load_task", flaky_task)
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + ["--output-dir", str(tmp_path / "a"), "--max-rounds", "2"])
    msg = capsys.readouterr().err.strip().splitlines()[-1]      # the run saved, then one line
    assert e.value.code == 1 and "ZeroDivisionError" in msg and "prompt '" in msg
    assert "completion '" in msg and f"resume with: python train.py --resume {tmp_path / 'a'}" in msg
    result = train.main(SMALL + ["--output-dir", str(tmp_path / "b"), "--max-rounds", "2",
                                 "--on-reward-error", "zero", "--eval-prompts", "5"])
    assert result["reward_errors"] > 0
    last = json.loads(open(tmp_path / "b" / "metrics.jsonl").readlines()[-1])
    assert last["reward_errors"] == result["reward_errors"]


def test_nan_steps_are_skipped_counted_and_stop_the_run(tmp_path, tiny_path, monkeypatch, capsys):
    import replay_rl
    real = replay_rl.policy_loss
    monkeypatch.setattr(replay_rl, "policy_loss", lambda *a, **k: (lambda l, m: (l * float("nan"), m))(*real(*a, **k)))
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + ["--output-dir", str(tmp_path), "--max-rounds", "50", "--max-skipped-steps", "3"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert e.value.code == 1 and len(err) == 1 and "3 steps in a row" in err[0], err   # one line
    assert "checkpoint saved to" in err[0] and "SystemExit" not in err[0]
    rows = step_rows(tmp_path)
    assert [r["skipped"] for r in rows] == [1, 1, 1] and rows[-1]["skipped_steps"] == 3


def test_skipped_step_leaves_weights_and_optimizer_unchanged(tiny_path, monkeypatch):
    import replay_rl
    from infra import engineered_update
    from rollout import end_token_ids, generate_rollouts
    import tasks
    model, tok = policy.load_policy(tiny_path, lora_r=4)
    task = tasks.addition_task(2)
    rollouts, _ = generate_rollouts(model, tok, ["1+2=", "3+4="], task.reward, num_generations=4, max_new_tokens=4, policy_version=0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    real = replay_rl.policy_loss
    monkeypatch.setattr(replay_rl, "policy_loss", lambda *a, **k: (lambda l, m: (l + float("inf"), m))(*real(*a, **k)))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    m = engineered_update.update_step_engineered(model, optimizer, rollouts, pad_id=tok.pad_token_id,
                                                 eos_ids=end_token_ids(model, tok)[0], current_version=0)
    assert m["skipped"] == 1 and not optimizer.state
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_out_of_memory_lists_the_knobs(tmp_path, tiny_path, monkeypatch, capsys):
    """Out of memory in a step: the run is saved as its round began (checkpoint-0: before round 1),
    then one line lists the knobs and names the resume."""
    from infra import engineered_update

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(replay_rl, "update_step", oom)
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + ["--output-dir", str(tmp_path), "--max-rounds", "2"])
    msg = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 1 and "out of GPU memory" in msg and "--load-in-4bit" in msg
    assert "--micro-batch-size" in msg and f"saved to {tmp_path / 'checkpoint-0'}" in msg
    assert checkpoint.read(str(tmp_path / "checkpoint-0")).state["round"] == 0


@pytest.mark.slow
def test_interrupt_at_the_end_of_a_round_still_evaluates_that_round(tmp_path, tiny_path, monkeypatch):
    """A signal during the last update of a round: the round is saved as it began and done again on
    resume, so the resumed run matches an uninterrupted one, eval lines included."""
    from infra import engineered_update
    flags = SMALL + ["--updates-per-round", "1", "--eval-every", "1", "--max-rounds", "4"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    train.main(flags + ["--output-dir", full])
    real, calls = replay_rl.update_step, []

    def interrupted_update(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)        # arrives during round 2's only update
        return real(*a, **k)

    monkeypatch.setattr(replay_rl, "update_step", interrupted_update)
    with pytest.raises(SystemExit) as e:
        train.main(flags + ["--output-dir", part])
    assert e.value.code == 128 + signal.SIGINT and checkpoint.find(part).endswith("checkpoint-1")
    monkeypatch.setattr(replay_rl, "update_step", real)
    train.main(["--resume", part, "--lr", "5e-4"])

    def lines(run):
        rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        return [{k: v for k, v in r.items() if not k.endswith("_seconds") and k != "lr"} for r in rows]
    a, b = lines(full), lines(part)
    assert [r["round"] for r in b if "eval_accuracy" in r] == [0, 1, 2, 3, 4]
    # identical up to round 1, evals included; round 2, cut short, is done again at the new lr
    assert a[:3] == b[:3] and [r["round"] for r in b] == [r["round"] for r in a]
    lr_after = [json.loads(line).get("lr") for line in open(os.path.join(part, "metrics.jsonl"))]
    assert [x for x in lr_after if x][-1] == 5e-4            # --lr on --resume reaches the optimizer


def test_a_damaged_checkpoint_falls_back_to_the_newest_that_loads(tmp_path, tiny_path, capsys):
    run = str(tmp_path / "run")
    train.main(SMALL + ["--output-dir", run, "--max-rounds", "3", "--save-every", "1", "--keep-checkpoints", "3"])
    damaged = os.path.join(run, "checkpoint-3", "buffer.safetensors")
    with open(damaged, "r+b") as f:                        # a truncated write, as a full disk leaves it
        f.truncate(40)
    capsys.readouterr()
    cfg = train.parse_config(["--resume", run, "--max-rounds", "4"])
    err = capsys.readouterr().err
    assert cfg.resume.endswith("checkpoint-2")
    assert "skipping" in err and "checkpoint-3" in err and "buffer.safetensors" in err and "Traceback" not in err
    named = os.path.join(run, "checkpoint-3")
    with pytest.raises(SystemExit) as e:                   # a named checkpoint that is damaged: one line
        train.parse_config(["--resume", named])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "damaged" in err[0] and "buffer.safetensors" in err[0]
    result = train.main(["--resume", run, "--max-rounds", "4"])          # goes on from checkpoint-2
    assert result["round"] == 4
    assert [json.loads(line)["step"] for line in open(os.path.join(run, "metrics.jsonl"))
            if "eval_accuracy" not in line] == list(range(1, 9))          # rounds 3-4 redone, nothing doubled
