"""Issue 69, nothing lost, round five (the rest): a reward cannot hold the run hostage. Each with a
real fault: a reward stuck in C code that holds the interpreter lock (sum(range(10**11))), a real
SIGTERM, a real os._exit, real child processes of a reward, a real SIGSTOP of a worker."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from infra import loading
from test_async import session, session_gone
from test_run_endings import ROUND_3, TINY, grader, last_line, lines, start, wait_for

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, process groups")
IN_C = "open(ready, 'w').close()\nsum(range(10**11))      # C code: the lock held, no signal seen"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_path):
    """The metrics of TINY never stopped, run as the runs here are (a process of its own, one
    thread: the same floating-point sums)."""
    folder = tmp_path_factory.mktemp("plain")
    run = str(folder / "run")
    proc = start(TINY + ["--reward", grader(folder), "--output-dir", run])
    assert proc.wait(timeout=300) == 0
    return lines(run)


def resumed(run: str) -> list[dict]:
    """The run resumed to its end (a process of its own), its metrics."""
    proc = start(["--resume", run])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return lines(run)


def errors(err: str) -> list[str]:
    """stderr's lines that say an error (the run's warnings aside)."""
    return [line for line in err.strip().splitlines() if "error" in line.lower()]


# ---- items 4, 8, 9: the reward in a process of its own ------------------------------------------
@pytest.mark.slow
@linux
def test_a_reward_stuck_in_c_code_ends_the_run_at_its_timeout_saved(tmp_path, uninterrupted):
    """Item 4: a reward in C code that never released the interpreter lock made the synchronous
    run ignore --reward-timeout 3 (and signals) for good; only kill -9 ended it, nothing saved.
    Now its process is ended at the limit: one line, the run saved as round 3 began, nothing of
    it left alive, and --resume gives the metrics of a run never stopped."""
    run = str(tmp_path / "run")
    proc = start(TINY + ["--reward", grader(tmp_path, IN_C, ROUND_3), "--reward-timeout", "3",
                         "--output-dir", run])
    wait_for(tmp_path / "ready", proc)
    began = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert time.monotonic() - began < 3 + loading.MARGIN + 10       # not 10**11 additions
    line = last_line(err)
    assert errors(err) == [line] and line.startswith("error: the reward function failed on "
                                                       "prompt "), err
    assert ("RewardTimeout: took longer than 3 s (--reward-timeout) and did not return to Python "
            "(C code that holds the interpreter lock?): its process was ended") in line
    assert line.endswith(f"; checkpoint saved to {run}/checkpoint-2; resume with: python train.py "
                         f"--resume {run}"), line
    assert session_gone(proc.pid)
    assert resumed(run) == uninterrupted


@pytest.mark.slow
@linux
def test_sigterm_is_heard_while_a_reward_holds_the_lock_in_c_code(tmp_path):
    """Item 4: SIGTERM (and Ctrl-C, twice) did nothing while the reward held the lock. Now the
    run hears it at once: saved as round 3 began, 128 + 15, its reward's process ended."""
    run = str(tmp_path / "run")
    proc = start(TINY + ["--reward", grader(tmp_path, IN_C, ROUND_3), "--reward-timeout", "600",
                         "--output-dir", run])
    wait_for(tmp_path / "ready", proc)
    time.sleep(0.5)                     # inside sum(range(...))
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - sent < 20
    assert f"interrupted: checkpoint saved to {run}/checkpoint-2" in err and "Traceback" not in err
    assert session_gone(proc.pid)


@pytest.mark.slow
@linux
def test_os_exit_in_a_reward_is_named_and_the_run_saved(tmp_path, uninterrupted):
    """Item 9: os._exit(7) in a reward ended the synchronous run with exit 7, no line, nothing
    saved. Now its process ends, not the run's: one line names the exit code, the run is saved
    as round 3 began, and --resume goes on exactly."""
    run = str(tmp_path / "run")
    proc = start(TINY + ["--reward", grader(tmp_path, "os._exit(7)", ROUND_3), "--output-dir",
                         run])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    line = last_line(err)
    assert errors(err) == [line] and line.startswith("error: the reward function failed on "
                                                       "prompt "), err
    assert "ended with exit code 7 (os._exit in the reward?)" in line, line
    assert line.endswith(f"; checkpoint saved to {run}/checkpoint-2; resume with: python train.py "
                         f"--resume {run}"), line
    assert session_gone(proc.pid)
    assert resumed(run) == uninterrupted


CHILDREN = """
    import subprocess
    subprocess.Popen(["sleep", "300"])          # a program the reward starts and forgets
    if os.fork() == 0:                          # a forked copy of the run that never ends
        time.sleep(300)
        os._exit(0)
"""


@pytest.mark.slow
@linux
def test_a_rewards_children_do_not_outlive_a_run_that_ended_well(tmp_path):
    """Item 8: a reward's children (a program it started, a process it forked: a full copy of the
    trainer) outlived a run that ended with exit 0. Now they end with the run."""
    run = str(tmp_path / "run")
    reward = grader(tmp_path, CHILDREN, 1)
    proc = start(TINY + ["--reward", reward, "--output-dir", run])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert session_gone(proc.pid, within=5), [open(f"/proc/{p}/cmdline").read()
                                              for p in session(proc.pid)]


def numbers(prompt, completion):
    """A reward whose values come in every form a reward may return them."""
    n = len(completion) + 3 * len(prompt)
    return [n / 7, np.float32(n / 3), torch.tensor(n / 11), np.array(n % 2 == 0), n][n % 5]


def test_a_reward_in_its_own_process_returns_what_it_returns_here():
    """The values are exactly the plain call's (a float each, the same bits), a closure keeps its
    state from call to call, and errors read as they did."""
    calls = []

    def counting(prompt, completion):           # a closure: it cannot be pickled, it is forked
        calls.append(1)
        if completion == "x":
            return 1 / 0
        return numbers(prompt, completion) + len(calls)

    pairs = [(f"{a}+{b}=", str(a + b) * (a % 4)) for a in range(20) for b in range(5)]
    apart = loading.CheckedReward(counting, "raise", timeout=10)
    assert apart.isolated
    there = [apart(p, c) for p, c in pairs]
    here = [loading.CheckedReward(counting, "raise")(p, c) for p, c in pairs]
    assert there == here and all(type(v) is float for v in there)
    pid = apart.process.pid
    with pytest.raises(loading.RewardError) as e:
        apart("1+2=", "x")                      # the reward's own exception, in its words
    assert "ZeroDivisionError: division by zero" in str(e.value)
    assert apart.process.pid == pid             # the same process goes on
    apart.close()
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()
