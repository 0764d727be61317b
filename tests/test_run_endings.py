"""Issue 54, nothing lost, round three: every way a run can end keeps its progress, and nothing but
the run's own process writes into its folder. Real processes, real process groups, real forks and
real files: a reward that forks and a Ctrl-C sent to the whole group; rewards that raise, call
sys.exit, raise KeyboardInterrupt, catch every exception or change the working directory; SIGHUP;
a second signal inside the save; checkpoints damaged inside their files; flags that are no finite
number; an adapter/ older than the newest checkpoint; a closed stdout; folders that cannot be
written; a task file with a byte-order mark."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from infra import checkpoint
from infra import report
from infra import runfolder
from infra import stopping
import tasks
import train
import replay_rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
# the smallest run: 4 rollouts a round, one step of 4, evals of 8 prompts at step 0 and the end;
# the reward is called 8 times by the step-0 eval, then 4 times a round
TINY = ["--prompts-per-round", "2", "--num-generations", "2", "--batch-size", "4", "--buffer-size",
        "4", "--eval-prompts", "8", "--max-rounds", "3", "--no-progress", "--no-plot"]
ROUND_3 = 8 + 4 + 4 + 1         # the first reward call of round 3's generation


def grader(tmp_path, action: str = "", at: int = 0) -> str:
    """A --reward that scores as the addition task does; its call number ``at`` (once: a marker
    file remembers it) first runs ``action``, where ``ready`` is a file that says it began."""
    marker, ready = tmp_path / "done-once", tmp_path / "ready"
    code = ["import os, sys, time",
            "import tasks",
            f"good, calls, ready = tasks.addition_task(2).reward, [], {str(ready)!r}",
            "def reward(prompt, completion):",
            "    calls.append(1)",
            f"    if len(calls) == {at} and not os.path.exists({str(marker)!r}):",
            f"        open({str(marker)!r}, 'w').close()",
            *("        " + line for line in textwrap.dedent(action).strip().splitlines()),
            "    return good(prompt, completion)"]
    (tmp_path / "grader.py").write_text("\n".join(code) + "\n")
    return f"{tmp_path / 'grader.py'}:reward"


def lines(run):
    """metrics.jsonl without its timings: what an exact resume gives again, line for line."""
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_path):
    """The metrics of TINY never stopped (the same rewards as every grader here)."""
    folder = tmp_path_factory.mktemp("plain")
    run = str(folder / "run")
    train.main(TINY + ["--reward", grader(folder), "--output-dir", run])
    return lines(run)


def start(args, cwd=ROOT, **env):
    """python train.py ARGS, in a session of its own (a process group, as a terminal makes)."""
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, **env}, start_new_session=True)


def wait_for(path, proc, seconds=120):
    deadline = time.time() + seconds
    while not os.path.exists(path):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, ended but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except FileNotFoundError:
        return False


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


# ---- 1. only the run's own process saves ---------------------------------------------------------
FORKS = """
    child = os.fork()
    if child == 0:          # a child that does not end on its own: it runs a copy of the trainer
        time.sleep(60)
    open(ready, "w").write(str(child))
    time.sleep(60)          # the trainer's reward call, still under way when Ctrl-C comes
"""


@pytest.mark.slow
def test_a_reward_that_forks_and_ctrl_c_to_the_process_group_saves_one_clean_checkpoint(
        tmp_path, uninterrupted):
    """Issue 54 (1): the forked child ran the stop handler too and saved into the same folder
    (FileExistsError, a checkpoint without its buffer, a dead end). The child now behaves as if
    no handler were installed; the run alone saves, once, and --resume continues exactly."""
    run = str(tmp_path / "run")
    proc = start(TINY + ["--reward", grader(tmp_path, FORKS, ROUND_3), "--output-dir", run])
    wait_for(tmp_path / "ready", proc)
    child = int((tmp_path / "ready").read_text())
    os.killpg(proc.pid, signal.SIGINT)                  # what a terminal's Ctrl-C sends
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    saved = os.path.join(run, "checkpoint-2")           # before round 3's generation
    assert err.count("checkpoint saved to") == 1 and f"checkpoint saved to {saved}" in err, err
    assert "FileExistsError" not in err and "FileNotFoundError" not in err
    assert sorted(os.listdir(run)) == [".lock", "checkpoint-2", "config.json", "metrics.jsonl"]
    checkpoint.read(saved)
    deadline = time.time() + 10                         # the child ended by its KeyboardInterrupt
    while alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(child)
    train.main(["--resume", run])
    assert lines(run) == uninterrupted


def test_a_forked_child_gets_the_signals_as_if_no_handler_were_installed():
    """SIGINT: KeyboardInterrupt in the child (not the stop's Interrupted, not a save); SIGTERM:
    the child ends by it. The run's own process keeps its handler. The handlers before it are set
    here to Python's own: what "no handler" means, whatever an earlier test in this process left
    (one CI run on a clean clone saw the child sleep through SIGINT, under pytest -n 2 only)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stop = stopping.StopRequest()
    try:
        outcomes = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            pid = os.fork()
            if pid == 0:
                code = 9
                try:
                    os.kill(os.getpid(), signum)
                    time.sleep(5)
                except KeyboardInterrupt:
                    code = 7
                except BaseException:
                    code = 8
                os._exit(code)
            outcomes[signum] = os.waitpid(pid, 0)[1]
        assert os.waitstatus_to_exitcode(outcomes[signal.SIGINT]) == 7
        assert os.waitstatus_to_exitcode(outcomes[signal.SIGTERM]) == -signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) is stop and stop.signum is None
    finally:
        stop.restore()
        for s, handler in before.items():
            signal.signal(s, handler)


def test_a_forked_child_writes_nothing_into_the_run_folder(tmp_path):
    """checkpoint.save, save_adapter, config.json and metrics.jsonl refuse in a process forked from
    the one that holds the run folder's lock; that process itself writes them."""
    run = str(tmp_path / "run")
    runfolder.lock_folder(run)
    try:
        pid = os.fork()
        if pid == 0:
            refused = 0
            for write in (lambda: checkpoint.save(run, {"round": 1, "step": 1}, {}, model=None,
                                                  optimizer=None, buffer=None, rng=None),
                          lambda: checkpoint.save_adapter(None, os.path.join(run, "adapter")),
                          lambda: report.save_config(run, {"x": 1}),
                          lambda: report.Report.row(type("R", (), {"metrics": 1,
                                                                   "run_dir": run})(), None, {})):
                try:
                    write()
                except runfolder.NotTheWriter:
                    refused += 1
                except BaseException:
                    pass
            os._exit(refused)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 4
        assert sorted(os.listdir(run)) == [".lock"]
        report.save_config(run, {"x": 1})               # the lock's own process
        assert sorted(os.listdir(run)) == [".lock", "config.json"]
    finally:
        runfolder.unlock_runs()


# ---- 2-3. every ending saves ------------------------------------------------------------------
ENDINGS = [("a reward that raises", "raise ValueError('grader broke')", 1,
            "error: the reward function failed on prompt "),
           ("SystemExit(3) from a reward", "sys.exit(3)", 3, "error: SystemExit(3) (raised at "),
           ("KeyboardInterrupt from a reward", "raise KeyboardInterrupt", 128 + signal.SIGINT,
            "error: KeyboardInterrupt (raised at ")]


@pytest.mark.slow
@pytest.mark.parametrize("what, action, code, words", ENDINGS, ids=[e[0] for e in ENDINGS])
def test_every_ending_saves_the_run_and_resume_continues_exactly(what, action, code, words,
                                                                 tmp_path, uninterrupted, capsys):
    """Issue 54 (2, 3): a reward that raised in round 3 lost the run at the default --save-every
    0 (SystemExit(3) even said nothing, a KeyboardInterrupt was called a second Ctrl-C). Each now
    saves the run before round 3's generation, names the cause, the checkpoint and the resume in
    one line, exits non-zero; --resume then gives the metrics of a run never stopped."""
    run = str(tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--reward", grader(tmp_path, action, ROUND_3), "--output-dir", run])
    line = last_line(capsys.readouterr().err)
    assert e.value.code == code and line.startswith(words), line
    assert line.endswith(f"; checkpoint saved to {run}/checkpoint-2; resume with: python "
                         f"train.py --resume {run}"), line
    if "KeyboardInterrupt" in what:
        assert "raised by the code, not by a signal" in line and "interrupted again" not in line
    train.main(["--resume", run])
    assert lines(run) == uninterrupted


def test_an_error_inside_a_step_saves_the_run_as_its_round_began(tmp_path, uninterrupted,
                                                                monkeypatch, capsys):
    """An exception of the loop's own (here the second step's, round 2's): the run as round 2
    began, so the resume does that round again, exactly."""
    from infra import engineered_update
    real, calls = replay_rl.update_step, []

    def breaks(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a bug in the step")
        return real(*args, **kwargs)

    run = str(tmp_path / "run")
    monkeypatch.setattr(replay_rl, "update_step", breaks)
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--reward", grader(tmp_path), "--output-dir", run])
    line = last_line(capsys.readouterr().err)
    assert e.value.code == 1 and line.startswith("error: RuntimeError: a bug in the step (raised")
    assert f"checkpoint saved to {run}/checkpoint-1;" in line
    monkeypatch.setattr(replay_rl, "update_step", real)
    train.main(["--resume", run])
    assert lines(run) == uninterrupted


@pytest.mark.slow
def test_sighup_saves_the_run(tmp_path, uninterrupted):
    """Issue 54 (10): a closed terminal (SIGHUP) killed the run with no save."""
    run = str(tmp_path / "run")
    proc = start(TINY + ["--reward", grader(tmp_path, "open(ready, 'w'); time.sleep(60)",
                                            ROUND_3), "--output-dir", run])
    wait_for(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGHUP, err
    assert f"interrupted: checkpoint saved to {run}/checkpoint-2" in err
    train.main(["--resume", run])
    assert lines(run) == uninterrupted


# ---- 4. a reward that catches everything ----------------------------------------------------
SWALLOWS = """
    open(ready, "w").close()
    while True:             # a grader that catches everything, the stop and the timeout too
        try:
            time.sleep(0.1)
        except BaseException:
            pass
"""


@pytest.mark.slow
def test_a_reward_that_catches_its_timeout_ends_the_run_saved(tmp_path, uninterrupted):
    """Issue 54 (4): `except BaseException: pass` in a loop defeated --reward-timeout 1. A second
    expiry now ends the process, the run saved as it was before that generation."""
    run = str(tmp_path / "run")
    proc = start(TINY + ["--reward", grader(tmp_path, SWALLOWS, ROUND_3), "--reward-timeout",
                         "1", "--output-dir", run])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    line = last_line(err)
    assert line.startswith("error: the reward function ignored its --reward-timeout of 1 s on "
                           "prompt "), line
    assert line.endswith(f"saved the run as it was before round 3 to {run}/checkpoint-2; "
                         f"resume with: python train.py --resume {run}"), line
    train.main(["--resume", run])
    assert lines(run) == uninterrupted


@pytest.mark.slow
def test_a_reward_that_catches_the_stop_is_given_up_naming_the_phase_and_saved(tmp_path):
    """Issue 54 (4): the first Ctrl-C was swallowed and, 30 s later, the watchdog said 'the step'
    and saved nothing. Now it names the round and saves the run as that round began."""
    run = str(tmp_path / "run")
    proc = start(TINY + ["--reward", grader(tmp_path, SWALLOWS, ROUND_3), "--reward-timeout",
                         "0", "--output-dir", run], REPLAY_RL_STOP_GRACE="2")
    wait_for(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert (f"round 3 did not stop within 2 s of SIGINT: saved the run as it was before "
            f"round 3 to {run}/checkpoint-2; resume with: python train.py --resume "
            f"{run}") in err
    checkpoint.read(os.path.join(run, "checkpoint-2"))


@pytest.mark.slow
def test_a_second_ctrl_c_that_the_reward_catches_still_exits_at_once(tmp_path):
    run = str(tmp_path / "run")
    proc = start(TINY + ["--reward", grader(tmp_path, SWALLOWS, ROUND_3), "--reward-timeout",
                         "0", "--output-dir", run], REPLAY_RL_STOP_GRACE="600")
    wait_for(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    start_time = time.time()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT and time.time() - start_time < 15, err
    assert (f"interrupted again: exited at once, without saving; no checkpoint yet: python "
            f"train.py --resume {run} starts the run again from its config") in err


@pytest.mark.slow
def test_a_second_signal_inside_the_save_leaves_nothing_half_written(tmp_path):
    """Issue 54 (10): a second Ctrl-C that landed while the stop's checkpoint was written left a
    partial .tmp-checkpoint-N."""
    run = str(tmp_path / "run")
    code = textwrap.dedent(f"""
        import os, signal, time, torch, rollout, train
        real_generate, real_save = rollout.generate_rollouts, torch.save
        def generate(*args, **kwargs):          # the first Ctrl-C, in round 1's generation
            os.kill(os.getpid(), signal.SIGINT)
            return real_generate(*args, **kwargs)
        def save(*args, **kwargs):              # the second, while optimizer.pt is written
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            return real_save(*args, **kwargs)
        rollout.generate_rollouts, torch.save = generate, save
        train.main({TINY + ['--output-dir', run]!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert "interrupted again: exited at once, without saving" in proc.stderr
    assert sorted(os.listdir(run)) == [".lock", "config.json", "metrics.jsonl"]
    assert train.main(["--resume", run])["round"] == 3        # not a dead end: it starts again


# ---- 9. a reward that changes the working directory ------------------------------------------
@pytest.mark.slow
def test_a_reward_that_changes_directory_moves_nothing_of_the_run(tmp_path):
    """Issue 54 (9): with the default runs/<time>, config.json, metrics.jsonl and .lock stayed in
    the first directory while the checkpoints and adapter/ went to the reward's; --resume then
    restarted from round 0. The run folder is absolute from the start."""
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir(), other.mkdir()
    reward = grader(tmp_path, f"os.chdir({str(other)!r})", 1)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *TINY, "--reward",
                           reward], cwd=first, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(other) == []
    [stamp] = os.listdir(first / "runs")
    run = first / "runs" / stamp
    assert {"config.json", "metrics.jsonl", ".lock", "checkpoint-3", "adapter"} <= set(
        os.listdir(run))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--resume",
                           f"runs/{stamp}", "--max-rounds", "4", "--no-progress"], cwd=first,
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(open(run / "metrics.jsonl").readlines()[-1])["round"] == 4
    assert [r["round"] for r in lines(run)].count(1) == 1      # round 1 was not run again


# ---- 7-8. damaged contents -------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tiny_path):
    """A TINY run of 2 rounds saved every round, B = N = 8 (round 1 idle, so that every rollout of
    checkpoint-2 is in round 3's batch): checkpoint-1 and checkpoint-2."""
    run = str(tmp_path_factory.mktemp("two") / "run")
    train.main(TINY + ["--buffer-size", "8", "--batch-size", "8", "--max-rounds", "2",
                       "--save-every", "1", "--output-dir", run])
    return run


def change_buffer(path, change):
    file = os.path.join(path, "buffer.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def change_state(path, change):
    file = os.path.join(path, "state.json")
    saved = json.load(open(file))
    change(saved)
    json.dump(saved, open(file, "w"))


def flip_length(t):
    t["completion_lens"][0] ^= 1 << 20


def rename_key(t):
    t["completion_idz"] = t.pop("completion_ids")


def out_of_vocabulary(t):
    t["completion_ids"][:] = 10**6                      # in every rollout: the newest are trained on


def nan_logp(t):
    t["behaviour_logp"][0] = float("nan")


def huge_advantage(t):
    t["advantage"][0] = 1e30


def string_round(saved):
    saved["state"]["round"] = "2"


def nan_adapter(path):
    file = os.path.join(path, "adapter", "adapter_model.safetensors")
    weights = load_file(file)
    next(iter(weights.values()))[0] = float("nan")
    save_file(weights, file)


DAMAGE = [("bit-flipped lengths", lambda p: change_buffer(p, flip_length), "completion_lens"),
          ("a renamed key", lambda p: change_buffer(p, rename_key), "no completion_ids"),
          ("a token id past the vocabulary", lambda p: change_buffer(p, out_of_vocabulary),
           "token id 1000000, past the model's vocabulary"),
          ("NaN log-probs", lambda p: change_buffer(p, nan_logp), "behaviour_logp holds NaN"),
          ("a 1e30 advantage", lambda p: change_buffer(p, huge_advantage), "advantage holds"),
          ("a string round", lambda p: change_state(p, string_round),
           "state.json (the loop state's round is '2'"),
          ("a NaN adapter weight", nan_adapter, "adapter/adapter_model.safetensors (")]


@pytest.mark.parametrize("what, damage, words", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_checkpoint_damaged_inside_its_files_is_skipped_for_the_newest_intact_one(
        what, damage, words, two_checkpoints, tmp_path, capsys):
    """Issue 54 (7): files that parse but hold corrupt contents were trusted (a split_with_sizes
    traceback, KeyError, IndexError at the first step, ValueError, or NaN accepted silently)."""
    run = str(tmp_path / "run")
    shutil.copytree(two_checkpoints, run)
    damage(os.path.join(run, "checkpoint-2"))
    cfg = train.parse_config(["--resume", run])
    assert cfg.resume == os.path.join(run, "checkpoint-1")
    err = capsys.readouterr().err
    assert f"skipping {run}/checkpoint-2: damaged, " in err and words in err, err


@pytest.mark.slow
def test_a_run_whose_newest_checkpoint_holds_a_token_past_the_vocabulary_goes_on(two_checkpoints,
                                                                                 tmp_path):
    """Trained on, that token id was an IndexError at the first step after the resume."""
    run = str(tmp_path / "run")
    shutil.copytree(two_checkpoints, run)
    change_buffer(os.path.join(run, "checkpoint-2"), out_of_vocabulary)
    result = train.main(["--resume", run, "--max-rounds", "3"])
    assert result["round"] == 3 and result["step"] == 2       # round 1 took no step


@pytest.mark.slow
def test_when_no_checkpoint_is_intact_the_way_forward_works_as_printed(two_checkpoints, tmp_path,
                                                                        capsys):
    """Issue 54 (8): every checkpoint damaged was a dead end (--resume: all damaged; --output-dir:
    it holds a run). The message now names commands that work: the checkpoints moved aside, then
    --resume starts the run again from its config.json in the same folder."""
    run = str(tmp_path / "run")
    shutil.copytree(two_checkpoints, run)
    for n in (1, 2):
        change_buffer(os.path.join(run, f"checkpoint-{n}"), nan_logp)
    with pytest.raises(SystemExit) as e:
        train.parse_config(["--resume", run])
    line = last_line(capsys.readouterr().err)
    assert e.value.code == 2 and "no checkpoint there is intact" in line
    move, again = line.split("move them aside: ", 1)[1].split(", then: ")
    assert again == f"python train.py --resume {run}"
    subprocess.run(move, shell=True, check=True)
    result = train.main(again.split()[2:])
    assert result["round"] == 2 and result["first_accuracy"] is not None
    assert [r["round"] for r in lines(run)][:2] == [0, 1]      # a new start, in the same folder


# ---- 6. flags that are no finite number -----------------------------------------------------
FLOATS = [f.name for f in __import__("dataclasses").fields(train.Config)
          if isinstance(f.default, float) and "choices" not in f.metadata]   # (--top-p: choices)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", FLOATS)
def test_a_flag_that_is_no_finite_number_is_refused_before_any_model(name, value, tmp_path,
                                                                     capsys):
    """Issue 54 (6): --lr nan gave a traceback after the model loaded (and a config.json that
    then refused the same command), --temperature inf trained with zero gradient, --reward-timeout
    nan meant no limit and a literal NaN in config.json."""
    flag = "--" + name.replace("_", "-")
    with pytest.raises(SystemExit) as e:
        train.main([f"{flag}={value}", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert err.endswith(f"{flag} {float(value)}: must be a finite number"), err
    assert not os.path.exists(tmp_path / "run")


def test_evaluate_refuses_a_temperature_that_is_no_finite_number(saved_run, capsys):
    import evaluate
    for value in ("nan", "inf"):
        with pytest.raises(SystemExit) as e:
            evaluate.parse([saved_run, "--num-generations", "2", "--temperature", value])
        assert e.value.code == 2 and "must be a finite number > 0" in capsys.readouterr().err


# ---- 10. the smaller ones ---------------------------------------------------------------------
def test_evaluate_takes_the_newest_checkpoint_over_an_older_final_adapter(saved_run, capsys):
    """Issue 54 (10): evaluate.py RUN evaluated adapter/ although the run had gone on (a resume
    past its end) and saved a newer checkpoint."""
    import evaluate
    parser = evaluate.build_parser()
    assert evaluate.locate(saved_run, "", parser)[0] == os.path.join(saved_run, "adapter")
    newer = os.path.join(saved_run, "checkpoint-3")
    shutil.copytree(os.path.join(saved_run, "checkpoint-1"), newer)
    save_file({"lora_A": torch.ones(2)}, os.path.join(newer, "adapter",
                                                      "adapter_model.safetensors"))
    assert evaluate.locate(saved_run, "", parser)[0] == os.path.join(newer, "adapter")
    assert f"evaluating {newer}" in capsys.readouterr().err


@pytest.mark.slow
def test_a_closed_stdout_is_no_traceback(tmp_path):
    """Issue 54 (10): train.py ... | head -2 ended in a BrokenPipeError traceback."""
    command = (f"{sys.executable} {os.path.join(ROOT, 'train.py')} "
               f"{' '.join(a for a in TINY if a != '--no-progress')} --max-rounds 1 "
               f"--output-dir {tmp_path / 'run'} | head -2; exit ${{PIPESTATUS[0]}}")
    proc = subprocess.run(["bash", "-c", command], env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 2, proc.stderr
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def output_dir_refused(folder, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--output-dir", str(folder)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "Traceback" not in err
    return last_line(err)


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    line = output_dir_refused(file, capsys)
    assert line == f"error: --output-dir {file}: is a file, not a folder; give another --output-dir"
    assert file.read_text() == "mine"


def test_a_read_only_disk_is_one_line(tmp_path, capsys):
    disk = tmp_path / "ro"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(disk)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        line = output_dir_refused(disk / "run", capsys)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert line.startswith(f"error: --output-dir {disk / 'run'}: cannot be written (Read-only "
                           "file system"), line


def test_an_immutable_folder_is_one_line(tmp_path, capsys):
    folder = tmp_path / "frozen"
    folder.mkdir()
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available on this file system")
    try:
        line = output_dir_refused(folder, capsys)
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert line.startswith(f"error: --output-dir {folder}: cannot be written ("), line


def test_a_task_file_with_a_byte_order_mark_reads(tmp_path):
    """Issue 54 (10): a BOM-prefixed file (as Windows editors save) read as 'line 1: not valid
    JSON'."""
    path = tmp_path / "qa.jsonl"
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1} #### {i + 1}"}
            for i in range(10)]
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    task = tasks.load_task(str(path))
    assert len(task.train_prompts) == 9 and task.train_prompts[0].startswith("What is 0 + 1?")
