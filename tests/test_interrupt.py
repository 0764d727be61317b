"""The first Ctrl-C / SIGTERM always keeps the run: wherever it arrives (a generation, an eval, a
step, before any update), the run stops at the next safe point with a checkpoint, and --resume
continues it exactly, as if it had never stopped; a stop that cannot save names how to go on."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from infra import checkpoint, engineered_update
import rollout
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--prompts-per-round", "4", "--num-generations", "4", "--buffer-size", "32", "--batch-size", "16",
         "--updates-per-round", "2", "--eval-prompts", "30", "--eval-every", "1", "--seed", "5",
         "--max-rounds", "3", "--no-progress", "--no-plot"]


def lines(run):
    """metrics.jsonl without its timings: what an exact resume must give again, line for line."""
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_path):
    run = str(tmp_path_factory.mktemp("full") / "run")
    train.main(FLAGS + ["--output-dir", run])
    return lines(run)


def signal_on_call(monkeypatch, module, name, call):
    """Send this process SIGINT at the start of call number ``call`` of module.name (it then runs
    on, as far as the stop lets it). Returns the real function and the numbers of the calls that
    returned."""
    real, calls, returned = getattr(module, name), [], []

    def wrapped(*args, **kwargs):
        calls.append(1)
        n = len(calls)
        if n == call:
            os.kill(os.getpid(), signal.SIGINT)
        out = real(*args, **kwargs)
        returned.append(n)
        return out

    monkeypatch.setattr(module, name, wrapped)
    return real, returned


# (what is interrupted, the function running then, its call, the checkpoint left): evals run at
# step 0 and after each round; generate_rollouts once a round; the step twice a round
WHERE = [("the step-0 eval", rollout, "greedy_rewards", 1, "checkpoint-0"),
         ("round 2's eval", rollout, "greedy_rewards", 3, "checkpoint-2"),
         ("round 2's generation", rollout, "generate_rollouts", 2, "checkpoint-1"),
         ("round 2's first step", engineered_update, "update_step_engineered", 3, "checkpoint-2")]


@pytest.mark.slow
@pytest.mark.parametrize("where, module, name, call, left", WHERE, ids=[w[0] for w in WHERE])
def test_a_first_sigint_anywhere_keeps_the_run_and_resume_continues_exactly(
        where, module, name, call, left, uninterrupted, tmp_path, monkeypatch, capsys):
    run = str(tmp_path / "run")
    real, returned = signal_on_call(monkeypatch, module, name, call)
    with pytest.raises(SystemExit) as e:
        train.main(FLAGS + ["--output-dir", run])         # the default --save-every 0
    assert e.value.code == 128 + signal.SIGINT
    # a generation or an eval is cut short at once, not waited for; a step is let finish
    assert (call in returned) == (name == "update_step_engineered")
    assert checkpoint.find(run) == os.path.join(run, left)
    err = capsys.readouterr().err
    assert f"interrupted: checkpoint saved to {os.path.join(run, left)}" in err
    assert f"resume with: python train.py --resume {run}" in err
    monkeypatch.setattr(module, name, real)
    train.main(["--resume", run])
    assert lines(run) == uninterrupted          # steps, evals and counters: as if never stopped


def test_a_reward_that_catches_every_exception_is_still_cut_short_by_the_stop(tmp_path, tiny_path):
    """The stop's exception is no Exception: a grader's `except Exception` cannot swallow it."""
    (tmp_path / "grader.py").write_text(textwrap.dedent(f"""
        import os, signal, time
        calls = []
        def reward(prompt, completion):
            calls.append(1)
            if len(calls) == 40:                # round 1's generation (30 eval calls first)
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(60)
                except Exception:
                    pass
            return float(completion.strip() == "1")
    """))
    run = str(tmp_path / "run")
    proc = start(FLAGS + ["--reward", f"{tmp_path / 'grader.py'}:reward", "--output-dir", run])
    _, err = proc.communicate(timeout=50)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert checkpoint.find(run) == os.path.join(run, "checkpoint-0") and "Traceback" not in err


def start(args, **env):
    code = f"import train; train.main({args!r})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **env})


def run_hanging(code: str, run: str) -> str:
    """Run ``code`` in a process of its own with a stop grace of 2 s; its stderr."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
                                 "REPLAY_RL_STOP_GRACE": "2"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    return err


@pytest.mark.slow
def test_a_step_longer_than_the_grace_keeps_the_run_and_resume_continues_exactly(
        tmp_path, uninterrupted):
    """Issue 54: the first Ctrl-C during a step that outlasts the grace (a large batch on a CPU)
    lost the run. Now the state from before that step is saved from the watchdog, the process
    exits, and the resume takes the step again: the same metrics as a run never stopped."""
    run = str(tmp_path / "run")
    err = run_hanging(f"""
        import os, signal, time, replay_rl, train
        from infra import engineered_update
        def hanging_step(*args, **kwargs):      # round 1's first step, far longer than the grace
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        engineered_update.update_step_engineered = hanging_step
        train.main({FLAGS + ['--output-dir', run]!r})
    """, run)
    assert (f"the step did not finish within 2 s of SIGINT: saved the run as it was before the "
            f"step to {run}/checkpoint-1; resume with: python train.py --resume {run}") in err
    assert checkpoint.read(os.path.join(run, "checkpoint-1")).state["pending_updates"] == 2
    train.main(["--resume", run])
    assert lines(run) == uninterrupted


@pytest.mark.slow
def test_an_optimizer_step_that_hangs_names_the_restart_which_works(tmp_path, tiny_path):
    """Inside the optimizer's own step the weights are half changed: nothing there is saved. After
    the grace given twice the stop exits; with no checkpoint yet the folder is not a dead end: the
    message names --resume, which starts the run again from its config."""
    run = str(tmp_path / "run")
    err = run_hanging(f"""
        import os, signal, time, torch, train
        def hanging(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        torch.optim.AdamW.step = hanging
        train.main({FLAGS + ['--output-dir', run]!r})
    """, run)
    assert (f"the step did not finish within 2 s of SIGINT: exited without saving; no checkpoint "
            f"yet: python train.py --resume {run} starts the run again from its config") in err
    assert checkpoint.find(run) is None
    result = train.main(["--resume", run, "--max-rounds", "1"])
    assert result["round"] == 1 and result["step"] == 2
    rows = lines(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 2]           # started again: eval, 2 steps, eval
