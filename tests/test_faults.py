"""Faults that lose nothing: a full disk while writing a checkpoint or metrics.jsonl is one line
with the intact checkpoint to resume from, and eval.json and curves.png are written whole or not
at all; a reward that hangs is cut off; a stop whose step
cannot finish exits in time, naming the last checkpoint; a second signal exits at once."""
import errno
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
from infra import report
import train
import replay_rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts-per-round", "4", "--num-generations", "4", "--batch-size", "16", "--buffer-size", "16",
         "--eval-prompts", "20", "--eval-every", "1000", "--no-progress", "--no-plot"]


def full_disk():
    """What torch.save raises on a full disk: a RuntimeError raised while handling the OSError."""
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 306304 vs 306196")


def test_a_full_disk_while_checkpointing_is_one_line_and_the_last_checkpoint_resumes(tmp_path, tiny_path,
                                                                                     monkeypatch):
    run = str(tmp_path / "run")
    real_save, calls = torch.save, []

    def save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:             # checkpoint-4's optimizer state
            full_disk()
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + ["--output-dir", run, "--max-rounds", "6", "--save-every", "2"])
    message = str(e.value.code)
    assert "\n" not in message and message.startswith("error: the disk is full: ")
    assert os.path.join(run, ".tmp-checkpoint-4", "optimizer.pt") in message
    assert f"the last checkpoint, {os.path.join(run, 'checkpoint-2')}, is intact" in message
    assert f"train.py --resume {run}" in message
    assert not os.path.exists(os.path.join(run, ".tmp-checkpoint-4"))           # the partial one removed
    monkeypatch.setattr(torch, "save", real_save)                                # space freed
    assert train.main(["--resume", run, "--max-rounds", "6"])["round"] == 6


def test_a_full_disk_while_writing_metrics_is_one_line(tmp_path, tiny_path, monkeypatch):
    run = str(tmp_path / "run")
    real_dumps, calls = json.dumps, []

    def dumps(obj, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_dumps(obj, *args, **kwargs)

    # report.py's json alone (transformers' own writes use the json module too)
    monkeypatch.setattr(report, "json", types.SimpleNamespace(dumps=dumps, dump=json.dump, load=json.load,
                                                              loads=json.loads))
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + ["--output-dir", run, "--max-rounds", "6"])
    message = str(e.value.code)
    assert message.startswith(f"error: the disk is full: {os.path.join(run, 'metrics.jsonl')} could not")
    assert "no checkpoint yet: free space, then python train.py --resume" in message and "\n" not in message


def hanging_reward(tmp_path, after: int) -> str:
    """A --reward whose call number `after` never returns (it leaves a file saying so first)."""
    marker = tmp_path / "hanging"
    (tmp_path / "hang.py").write_text(textwrap.dedent(f"""
        import time
        calls = []
        def reward(prompt, completion):
            calls.append(1)
            if len(calls) == {after}:
                open({str(marker)!r}, "w").close()
                time.sleep(10**6)
            return float(completion.strip() == "1")
    """))
    return f"{tmp_path / 'hang.py'}:reward"


def start(args, **env):
    code = f"import train; train.main({args!r})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **env})


def wait_for(path, proc, seconds=120):
    deadline = time.time() + seconds
    while not os.path.exists(path):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.1)


@pytest.mark.slow
def test_a_reward_that_hangs_is_cut_off_by_the_timeout(tmp_path, tiny_path):
    flags = SMALL + ["--reward", hanging_reward(tmp_path, 50), "--reward-timeout", "1", "--max-rounds", "5"]
    proc = start(flags + ["--output-dir", str(tmp_path / "a")])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err
    last = err.strip().splitlines()[-1]                  # (libraries may warn on lines before it)
    assert last.startswith("error: the reward function failed on prompt ")
    assert "RewardTimeout: took longer than 1 s (--reward-timeout)" in last
    os.remove(tmp_path / "hanging")
    proc = start(flags + ["--output-dir", str(tmp_path / "b"), "--on-reward-error", "zero"])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    last = json.loads(open(tmp_path / "b" / "metrics.jsonl").readlines()[-1])
    assert last["reward_errors"] == 1


def hanging_step(after: int) -> str:
    """Code that makes train's optimizer step number `after` hang (after saying so in a file)."""
    return textwrap.dedent(f"""
        import os, time, replay_rl
        from infra import engineered_update
        real, calls = replay_rl.update_step, []
        def step(*args, **kwargs):
            calls.append(1)
            if len(calls) == {after}:
                open(os.environ["HANGING"], "w").close()
                while True:                     # a step that does not stop: the first signal's
                    try:                        # Interrupted is caught, the second's not
                        time.sleep(10**6)
                    except BaseException as e:
                        if type(e).__name__ != "Interrupted":
                            raise
            return real(*args, **kwargs)
        replay_rl.update_step = step
    """)


def start_hanging(tmp_path, args, after, **env):
    code = hanging_step(after) + f"import train; train.main({args!r})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
                                            "HANGING": str(tmp_path / "hanging"), **env})


@pytest.mark.slow
def test_a_stop_whose_step_hangs_exits_in_time_saving_the_run_before_that_step(tmp_path, tiny_path):
    """Past the grace the hanging step (round 3's) is given up: the run as round 3 began
    (checkpoint-2) is saved from the watchdog thread."""
    run = str(tmp_path / "run")
    proc = start_hanging(tmp_path, SMALL + ["--save-every", "1", "--max-rounds", "100", "--output-dir", run], 3,
                         REPLAY_RL_STOP_GRACE="2")
    wait_for(tmp_path / "hanging", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT
    assert "what does not stop within 2 s is given up" in err
    last = os.path.join(run, "checkpoint-2")
    assert (f"round 3 did not stop within 2 s of SIGINT: saved the run as it was before round 3 "
            f"to {last}; resume with: python train.py --resume {run}") in err
    assert checkpoint.find(run) == last and checkpoint.read(last).state["step"] == 2


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once_naming_how_to_go_on(tmp_path, tiny_path):
    run = str(tmp_path / "run")
    proc = start_hanging(tmp_path, SMALL + ["--max-rounds", "100", "--output-dir", run], 1,
                         REPLAY_RL_STOP_GRACE="600")
    wait_for(tmp_path / "hanging", proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert proc.poll() is None                       # the first waits for its step (600 s)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err
    assert (f"interrupted again: exited at once, without saving; no checkpoint yet: python train.py --resume "
            f"{run} starts the run again from its config") in err


@pytest.mark.slow
def test_a_reward_that_hangs_is_cut_short_by_the_first_stop(tmp_path, tiny_path):
    """A reward that never returns holds up a generation, which the first signal cuts short: the
    run is saved (no grace to wait out), the round it was in done again on resume."""
    run = str(tmp_path / "run")
    proc = start(SMALL + ["--reward", hanging_reward(tmp_path, 50), "--reward-timeout", "0", "--save-every", "1",
                          "--max-rounds", "100", "--output-dir", run], REPLAY_RL_STOP_GRACE="600")
    wait_for(tmp_path / "hanging", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert f"interrupted: checkpoint saved to {checkpoint.find(run)}" in err and "Traceback" not in err


def test_a_full_disk_leaves_eval_json_and_curves_png_whole_or_untouched(tmp_path, monkeypatch):
    import evaluate
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from infra import curves

    path = str(tmp_path / "eval.json")
    evaluate.write(path, {"eval_accuracy": 0.5})
    real_dump = json.dump

    def dump(obj, f, **kwargs):                    # half of it written, then no space
        f.write('{"eval_accuracy": 0.')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", dump)
    with pytest.raises(SystemExit) as e:
        evaluate.write(path, {"eval_accuracy": 0.75})
    assert str(e.value.code).startswith(f"error: the disk is full: {path} could not be written")
    monkeypatch.setattr(json, "dump", real_dump)
    assert json.load(open(path)) == {"eval_accuracy": 0.5} and os.listdir(tmp_path) == ["eval.json"]

    png = str(tmp_path / "curves.png")
    fig = plt.figure()
    curves.save(fig, png, dpi=20)
    whole = open(png, "rb").read()

    def savefig(target, **kwargs):
        open(target, "wb").write(b"\x89PNG half")
        full_disk()

    monkeypatch.setattr(fig, "savefig", savefig)
    with pytest.raises(RuntimeError):              # report.curves turns this into one warning
        curves.save(fig, png, dpi=20)
    assert open(png, "rb").read() == whole and sorted(os.listdir(tmp_path)) == ["curves.png", "eval.json"]
    plt.close(fig)
