"""A run folder is one run's: a second run is refused before any model, default names never
collide, one process writes a folder at a time (a run's, evaluate.py's eval.json, a comparison's);
metrics.jsonl is cut on resume, never padded; inputs that would train nothing (a temperature near
0, a reward that is not a number) or that the model cannot take (a prompt beyond its context) are
refused before the model is loaded."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from infra import checkpoint
from infra import loading
from infra import runfolder
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--max-rounds", "4", "--prompts-per-round", "4", "--num-generations", "4", "--batch-size", "16",
         "--buffer-size", "16", "--eval-prompts", "20", "--save-every", "2", "--no-progress", "--no-plot"]


def no_model(monkeypatch):
    """Loading a model fails the test: what is checked must be refused before it."""
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_path):
    """A finished SMALL run (4 rounds, checkpoints 2 and 4): its folder and a copy of its files."""
    run = str(tmp_path_factory.mktemp("runs") / "run")
    train.main(SMALL + ["--output-dir", run])
    files = {name: open(os.path.join(run, name), "rb").read() for name in ("metrics.jsonl", "config.json")}
    return run, files


def test_a_new_run_into_a_folder_holding_a_run_is_refused_before_any_model(finished, monkeypatch, capsys):
    run, files = finished
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + ["--max-rounds", "2", "--seed", "1", "--output-dir", run])
    assert e.value.code == 2
    assert f"--output-dir {run}: it holds a run; continue it with --resume {run}" in one_line_error(capsys)
    assert all(open(os.path.join(run, name), "rb").read() == data for name, data in files.items())
    assert checkpoint.rounds(run) == [2, 4]


def test_default_run_folders_are_unique_within_one_second(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261201-120000")
    folders = [runfolder.new_run_dir(str(tmp_path / "runs")) for _ in range(3)]
    assert [os.path.basename(f) for f in folders] == ["20261201-120000", "20261201-120000-2", "20261201-120000-3"]
    assert all(os.path.isdir(f) and not os.listdir(f) for f in folders)


def hold_lock(run, name=".lock"):
    """Another process that holds the folder's lock (name) until killed."""
    code = textwrap.dedent(f"""
        import sys
        from infra import runfolder
        runfolder.lock_folder({run!r}, {name!r})
        print("locked", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_folder_written_by_another_process_is_refused_and_freed_when_it_dies(finished, tmp_path, monkeypatch,
                                                                               capsys):
    run, _ = finished
    holder = hold_lock(run)
    try:
        no_model(monkeypatch)
        with pytest.raises(SystemExit) as e:
            train.main(["--resume", run, "--max-rounds", "5"])
        assert e.value.code == 2
        assert f"{run} is being written by pid {holder.pid}" in one_line_error(capsys)
        with pytest.raises(SystemExit):                  # a new run into a new folder the holder locked
            fresh = str(tmp_path / "fresh")
            hold_fresh = hold_lock(fresh)
            try:
                train.main(SMALL + ["--output-dir", fresh])
            finally:
                hold_fresh.kill()
        assert "is being written by" in one_line_error(capsys)
    finally:
        holder.send_signal(signal.SIGKILL)               # a crash: the OS releases its lock
        holder.wait()
    runfolder.lock_run(run)                              # not stale: free at once
    runfolder.unlock_runs()


def test_a_shortened_metrics_file_is_refused_on_resume_never_padded(tmp_path, tiny_path, monkeypatch, capsys):
    run = str(tmp_path / "run")
    train.main(SMALL + ["--output-dir", run])
    metrics = os.path.join(run, "metrics.jsonl")
    whole = open(metrics, "rb").read()
    with open(metrics, "r+b") as f:                       # `truncate -s -300`
        f.truncate(len(whole) - 300)
    real_load = loading.load_model
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", run, "--max-rounds", "6"])
    assert e.value.code == 2
    assert "fewer than the" in one_line_error(capsys)
    assert open(metrics, "rb").read() == whole[:-300]     # untouched: no NUL byte
    with open(metrics, "ab") as f:                        # as long again, but another file: mid-line
        f.write(b"x" * 600)
    with pytest.raises(SystemExit):
        train.main(["--resume", run, "--max-rounds", "6"])
    assert "ends no line" in one_line_error(capsys)
    os.rename(metrics, metrics + ".old")                  # moved away: a new file from the checkpoint on
    monkeypatch.setattr(loading, "load_model", real_load)
    train.main(["--resume", run, "--max-rounds", "6"])
    rows = [json.loads(line) for line in open(metrics)]
    assert rows and rows[0]["round"] == 5 and b"\0" not in open(metrics, "rb").read()


def test_a_temperature_that_trains_nothing_and_a_reward_that_is_no_number_are_refused(tmp_path, tiny_path,
                                                                                      monkeypatch, capsys):
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        train.main(SMALL + ["--temperature", "1e-08", "--output-dir", str(tmp_path / "t")])
    assert e.value.code == 2 and "--temperature 1e-08: below 0.01" in one_line_error(capsys)
    assert not os.path.exists(tmp_path / "t")
    reward = loading.CheckedReward(lambda p, c: "1.0", "raise")
    with pytest.raises(loading.RewardError, match="returned str '1.0', not a number"):
        reward("1+2=", "3")
    assert loading.CheckedReward(lambda p, c: "1.0", "zero")("1+2=", "3") == 0.0
    assert [loading.CheckedReward(lambda p, c, v=v: v, "raise")("p", "c") for v in (True, 1, 0.5)] == [1.0, 1.0, 0.5]


def test_a_second_writer_of_an_eval_json_or_a_comparison_folder_is_refused(finished, tmp_path, monkeypatch,
                                                                          capsys):
    import compare
    import evaluate

    run, _ = finished
    no_model(monkeypatch)
    holder = hold_lock(run, ".eval.json.lock")          # an evaluate.py writing run/eval.json
    try:
        with pytest.raises(SystemExit) as e:
            evaluate.main([run])
        assert e.value.code == 2
        assert f"{os.path.join(run, 'eval.json')}: {run} is being written by pid {holder.pid} (an evaluate.py " \
               "writing it): wait for it to end, or use another --output" in one_line_error(capsys)
        other = str(tmp_path / "other.json")             # another file: no conflict
        assert evaluate.parse([run, "--output", other]).output == other
    finally:
        holder.kill()
        holder.wait()
    comparison = str(tmp_path / "cmp")
    holder = hold_lock(comparison)
    monkeypatch.setattr(compare, "run_train", lambda *a: pytest.fail("a run started"))
    try:
        with pytest.raises(SystemExit) as e:
            compare.main(["--quick", "--output-dir", comparison])
        assert e.value.code == 2
        assert f"{comparison} is being written by pid {holder.pid} (a comparison in progress)" in one_line_error(capsys)
    finally:
        holder.kill()
        holder.wait()


def test_a_prompt_beyond_the_models_context_is_refused_before_the_model(tmp_path, tiny_path, monkeypatch, capsys):
    from infra import policy

    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    run = str(tmp_path / "run")
    with pytest.raises(SystemExit) as e:                 # the demo model: 128 positions, prompts of 6 tokens
        train.main(SMALL + ["--max-new-tokens", "123", "--output-dir", run])
    assert e.value.code == 2
    assert one_line_error(capsys) == (
        "error: --model tiny: training prompt 1 of 9500 ('75+60=...') is 6 tokens: with 123 new tokens, more "
        "than the model's context of 128; --max-new-tokens 122 or less, or a shorter prompt")
    assert not runfolder.holds_run(run)                 # nothing of a run: the same command may be fixed and rerun
    with pytest.raises(SystemExit):
        train.main(SMALL + ["--max-new-tokens", "128", "--output-dir", run])
    assert "128 new tokens (--max-new-tokens) leave no room for a prompt" in one_line_error(capsys)
    monkeypatch.undo()
    assert train.main(SMALL + ["--max-new-tokens", "122", "--max-rounds", "1", "--output-dir", run])["round"] == 1
