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
from infra import generation
import rollout
import train
import replay_rl

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
# step 0 and after each round; generate_rollouts once a round; the step twice a round. Whatever
# is cut short in round 2, the run is saved as round 2 began: checkpoint-1
WHERE = [("the step-0 eval", generation, "greedy_rewards", 1, "checkpoint-0"),
         ("round 2's eval", generation, "greedy_rewards", 3, "checkpoint-1"),
         ("round 2's generation", rollout, "generate_rollouts", 2, "checkpoint-1"),
         ("round 2's first step", replay_rl, "update_step", 3, "checkpoint-1")]


@pytest.mark.slow
@pytest.mark.parametrize("where, module, name, call, left", WHERE, ids=[w[0] for w in WHERE])
def test_a_first_sigint_anywhere_keeps_the_run_and_resume_continues_exactly(
        where, module, name, call, left, uninterrupted, tmp_path, monkeypatch, capsys):
    run = str(tmp_path / "run")
    real, returned = signal_on_call(monkeypatch, module, name, call)
    with pytest.raises(SystemExit) as e:
        train.main(FLAGS + ["--output-dir", run])         # the default --save-every 0
    assert e.value.code == 128 + signal.SIGINT
    # cut short at once, not waited for: a generation, an eval, a step alike
    assert call not in returned
    assert checkpoint.find(run) == os.path.join(run, left)
    err = capsys.readouterr().err
    assert f"interrupted: checkpoint saved to {os.path.join(run, left)}" in err
    assert f"resume with: python train.py --resume {run}" in err
    monkeypatch.setattr(module, name, real)
    train.main(["--resume", run])
    assert lines(run) == uninterrupted          # steps, evals and counters: as if never stopped


@pytest.mark.parametrize("timeout, the_run", [("0", "os.getpid()"), ("30", "os.getppid()")])
def test_a_reward_that_catches_every_exception_is_still_cut_short_by_the_stop(tmp_path, tiny_path,
                                                                            timeout, the_run):
    """The stop's exception is no Exception: a grader's `except Exception` cannot swallow it. With
    --reward-timeout 0 the reward runs in the run's process (the Ctrl-C is its own); with a limit
    in a process of its own, forked from the run (the Ctrl-C goes to its parent, the run)."""
    (tmp_path / "grader.py").write_text(textwrap.dedent(f"""
        import os, signal, time
        calls = []
        def reward(prompt, completion):
            calls.append(1)
            if len(calls) == 40:                # round 1's generation (30 eval calls first)
                try:
                    os.kill({the_run}, signal.SIGINT)
                    time.sleep(60)
                except Exception:
                    pass
            return float(completion.strip() == "1")
    """))
    run = str(tmp_path / "run")
    proc = start(FLAGS + ["--reward", f"{tmp_path / 'grader.py'}:reward", "--output-dir", run,
                          "--reward-timeout", timeout])
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
@pytest.mark.parametrize("hangs", ["update_step", "AdamW.step"])
def test_a_step_that_will_not_stop_is_given_up_and_resume_continues_exactly(
        hangs, tmp_path, uninterrupted):
    """Issue 54: the first Ctrl-C during a step that outlasts the grace lost the run. A step (here
    one that catches the stop and goes on waiting), or the optimizer's own step inside it (its
    weights half changed), is given up after the grace: the run as round 1 began is saved from the
    watchdog, the process exits, and the resume does round 1 again: the same metrics as a run
    never stopped."""
    run = str(tmp_path / "run")
    target = "replay_rl.update_step" if hangs == "update_step" else "torch.optim.AdamW.step"
    err = run_hanging(f"""
        import os, signal, time, torch, replay_rl, train
        def hanging_step(*args, **kwargs):      # round 1's first step, far longer than the grace
            sent = False
            while True:
                try:
                    if not sent:
                        sent = True
                        os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(60)
                except BaseException:           # the stop's exception too: it goes on
                    pass
        {target} = hanging_step
        train.main({FLAGS + ['--output-dir', run]!r})
    """, run)
    assert (f"round 1 did not stop within 2 s of SIGINT: saved the run as it was before round 1 "
            f"to {run}/checkpoint-0; resume with: python train.py --resume {run}") in err
    assert checkpoint.read(os.path.join(run, "checkpoint-0")).state["step"] == 0
    train.main(["--resume", run])
    assert lines(run) == uninterrupted
