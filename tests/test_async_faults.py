"""--generators under real faults (issue 62): a worker stopped with SIGSTOP, a resume, a Ctrl-C while
the workers start, a trainer killed while they load, a reward that forks or calls sys.exit, a
file-size limit; and the clock: no worker generates while the trainer evaluates. Each fault is the
real one (a real signal, a real rlimit, a real fork), never a stand-in; "nothing left" is every
process of the run's session gone (the workers lead process groups of their own within it)."""
import contextlib
import multiprocessing.context
import os
import resource
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import async_rl
from infra import workers as worker_processes
from infra import stopping
import train
from test_async import (ROOT, SMALL, final_state, resume, reward_file, rows, rows_safe,
                        session, session_gone, start, wait_for_step, workers)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, signals, rlimits")


def steps_and_uses(run):
    """(step rows, the most uses any rollout had when it left the buffer)."""
    all_rows = rows(run)
    steps = [r for r in all_rows if "is_ratio_mean" in r]
    left = next(r["left_by_uses"] for r in reversed(all_rows) if "left_by_uses" in r)
    return steps, max(i for i, n in enumerate(left) if n)


def stop_for_good(pid: int, settle: float = 3.0) -> None:
    """SIGSTOP that stays: sent while the worker runs (not while the trainer holds it for an eval,
    which would continue it after: the trainer cannot tell that stop from its own), and sent again
    if an eval under way continued it within ``settle`` seconds."""
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline:
        if not stopping.stopped(pid):
            os.kill(pid, signal.SIGSTOP)
        time.sleep(0.02)


@pytest.mark.slow
@linux
def test_a_stalled_worker_is_named_the_run_saved_and_reuse_stays_within_the_cap(tmp_path, tiny_path):
    """kill -STOP of the worker: the trainer (--step-when-held, the paper's) steps on what it holds
    until every rollout has had
    --max-uses uses, then waits; after --worker-timeout one line names the worker, the run is saved
    (exit 1), the stopped worker is ended with it, and --resume goes on."""
    run = str(tmp_path / "run")
    proc = start(run, "--max-rounds", "400", "--buffer-size", "32", "--max-uses", "3",
                 "--worker-timeout", "4", "--step-when-held")
    wait_for_step(run, proc, steps=2)
    (worker,) = workers(proc.pid)
    stopped = time.monotonic()
    stop_for_good(worker)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert f"generation worker 0 (pid {worker}) gave no sign of life for" in last, err
    assert "--worker-timeout 4" in last and "checkpoint saved to" in last
    assert 4 < time.monotonic() - stopped < 30
    assert session_gone(proc.pid, within=5)
    steps, most = steps_and_uses(run)
    assert most <= 3 and all(r["uses_mean"] <= 3 for r in steps)
    saved = final_state(run)
    assert saved["retired_at_cap"] > 0
    # the resume's worker loads under whatever else runs: 4 s could pass without a beat there
    done = resume(run, "--max-rounds", str(saved["round"] + 2), "--worker-timeout", "60")
    assert done.returncode == 0, done.stderr
    assert final_state(run)["round"] == saved["round"] + 2


@pytest.mark.slow
@linux
def test_a_resume_takes_no_step_before_a_round_arrives(tmp_path, tiny_path):
    """--step-when-held steps on what the buffer holds, but a resumed buffer is not stepped on while
    the workers load: the first row after the resume is a round's, and no rollout goes past
    --max-uses."""
    run = str(tmp_path / "run")
    proc = start(run, "--max-rounds", "400", "--buffer-size", "32", "--step-when-held")
    wait_for_step(run, proc, steps=3)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    saved = final_state(run)
    before = len(rows(run))
    done = resume(run, "--max-rounds", str(saved["round"] + 3))
    assert done.returncode == 0, done.stderr
    after = [r for r in rows(run)[before - 1:] if "eval_accuracy" not in r]
    first = next(r for r in after if r["round"] > saved["round"] or r["step"] > saved["step"])
    assert first["updates"] == 0 and first["round"] == saved["round"] + 1, first
    steps, most = steps_and_uses(run)
    assert most <= 4


def workers_run(tiny_path, generators: int):
    """What Generators reads of train.Run: a small config, the demo policy (LoRA r 4), a
    StopRequest, no loop state, a reporter whose clock reads 0."""
    from infra.policy import load_policy
    model, _ = load_policy(tiny_path, lora_r=4)
    cfg = train.Config(generators=generators, buffer_size=16, batch_size=16, prompts_per_round=2,
                       num_generations=8)
    return types.SimpleNamespace(cfg=cfg, model=model, stop=stopping.StopRequest(), state=None,
                                 reporter=types.SimpleNamespace(tick=lambda state: 0.0),
                                 pause_workers=contextlib.nullcontext)


@linux
def test_a_ctrl_c_while_the_workers_start_is_kept(monkeypatch, tiny_path):
    """A real SIGINT to the trainer while it starts its workers (sent from inside Process.start):
    the stop is requested once they are started, not lost."""
    run = workers_run(tiny_path, generators=1)
    stop = run.stop
    start_process = multiprocessing.context.SpawnProcess.start

    def start_with_a_ctrl_c(self):
        os.kill(os.getpid(), signal.SIGINT)
        return start_process(self)
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start_with_a_ctrl_c)
    monkeypatch.setattr(worker_processes.Generators, "account", lambda self, state: None)
    try:
        with worker_processes.Generators(run, async_rl.worker_loop):
            time.sleep(0.1)
            assert stop.requested()
    finally:
        stop.restore()


REFUSED_BEFORE_LOADING = [
    (["--generators", "1000"], "--generators 1000: 1000 workers on the CPU, more than its"),
    (["--generators", "1", "--generator-devices", "nonsense"], "'nonsense' is not a device"),
    (["--generators", "2", "--generator-devices", "cpu,,cpu"], "'' is not a device"),
    (["--generators", "1", "--generator-devices", "cuda:1"], "cuda:1 is not here"),
    # issue 69, item 10: checked once per worker, 10**9 of them spun for minutes
    (["--generators", "1000000000"], "--generators 1000000000: 1000000000 workers on the CPU"),
    (["--generators", "1000000001", "--generator-devices", "cpu,cpu"],
     "1000000001 workers on the CPU")]


@linux
def test_a_start_cut_short_leaves_no_worker_and_no_launcher_folder(monkeypatch, tiny_path):
    """A second Ctrl-C (a KeyboardInterrupt) while the trainer starts its workers, after the
    launcher folder and the first worker exist: what started is stopped and the folder removed on
    the way out; it was left for the next start to remove (issue 69, item 13)."""
    import glob
    import tempfile
    run = workers_run(tiny_path, generators=2)
    start_process, started = multiprocessing.context.SpawnProcess.start, []

    def second_start_interrupted(self):
        if started:
            raise KeyboardInterrupt
        start_process(self)
        started.append(self)
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", second_start_interrupted)
    mine = os.path.join(tempfile.gettempdir(), f"replay-rl-{os.getpid()}-*")
    try:
        with pytest.raises(KeyboardInterrupt):
            with worker_processes.Generators(run, async_rl.worker_loop):
                pass
    finally:
        run.stop.restore()
    assert len(started) == 1 and not started[0].is_alive() and started[0].exitcode is not None
    assert glob.glob(mine) == []


@linux
def test_a_second_ctrl_c_while_the_workers_stop_kills_them_and_removes_the_folder(monkeypatch,
                                                                                 tiny_path):
    """The first Ctrl-C ends the with block, and the second arrives while the trainer waits for
    its workers to stop: it waits no longer, kills them, removes the launcher folder, and the
    KeyboardInterrupt goes on (issue 69, item 13: the folder was left for the next start)."""
    import glob
    import tempfile
    run = workers_run(tiny_path, generators=1)
    monkeypatch.setattr(worker_processes.Generators, "account", lambda self, state: None)
    mine = os.path.join(tempfile.gettempdir(), f"replay-rl-{os.getpid()}-*")
    join = multiprocessing.process.BaseProcess.join

    def join_interrupted(self, timeout=None):
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", join)
        raise KeyboardInterrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            with worker_processes.Generators(run, async_rl.worker_loop) as generators:
                assert len(glob.glob(mine)) == 1
                procs = list(generators.procs)
                monkeypatch.setattr(multiprocessing.process.BaseProcess, "join",
                                    join_interrupted)
                raise stopping.Interrupted("SIGINT")
    finally:
        run.stop.restore()
    procs[0].join(10)
    assert not procs[0].is_alive() and procs[0].exitcode is not None
    assert glob.glob(mine) == []


@pytest.mark.parametrize("flags, says", REFUSED_BEFORE_LOADING,
                         ids=[" ".join(f) for f, _ in REFUSED_BEFORE_LOADING])
def test_workers_the_machine_cannot_hold_are_refused_before_anything_loads(flags, says, tmp_path):
    if "cuda:1" in flags and torch.cuda.device_count() > 1:
        pytest.skip("this machine has a cuda:1")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *flags,
                           "--output-dir", str(out)], capture_output=True, text=True, timeout=120)
    err = [line for line in done.stderr.strip().splitlines() if "publisher trust" not in line]
    assert done.returncode == 2 and len(err) == 1 and says in err[0], done.stderr
    assert not out.exists()


@pytest.mark.slow
@linux
def test_workers_die_within_a_second_of_a_trainer_killed_while_they_load(tmp_path, tiny_path):
    run = str(tmp_path / "run")
    proc = start(run, "--generators", "2", "--max-rounds", "400")
    deadline = time.monotonic() + 60
    while len(workers(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)   # at once: the workers are still importing torch
    proc.wait(timeout=10)
    assert session_gone(proc.pid, within=3.0), [
        (pid, open(f"/proc/{pid}/stat").read()[:60], open(f"/proc/{pid}/cmdline", "rb").read()[:80])
        for pid in session(proc.pid)]     # ~0.3 s on idle cores
    assert "resource_tracker" not in proc.stderr.read()     # no warning after the run has ended


FORK = """if calls[0] == 60:
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
"""


@pytest.mark.slow
@linux
@pytest.mark.parametrize("ending", ["the end of the run", "a Ctrl-C to the group"])
def test_what_a_reward_forks_in_a_worker_ends_with_the_run(ending, tmp_path, tiny_path):
    run = str(tmp_path / "run")
    reward, _ = reward_file(tmp_path, FORK)
    proc = start(run, "--max-rounds", "10" if ending == "the end of the run" else "400",
                 "--reward", reward)
    if ending != "the end of the run":
        wait_for_step(run, proc, steps=4)
        os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == (0 if ending == "the end of the run" else 130), err
    assert session_gone(proc.pid, within=3.0), session(proc.pid)


@pytest.mark.slow
@linux
def test_a_reward_that_calls_sys_exit_in_a_worker_is_named_and_its_code_kept(tmp_path, tiny_path):
    run = str(tmp_path / "run")
    reward, _ = reward_file(tmp_path, "sys.exit(3)\n")
    proc = start(run, "--max-rounds", "30", "--reward", reward)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err
    last = err.strip().splitlines()[-1]
    assert "generation worker 0 failed: the reward function called sys.exit(3) on prompt '" in last
    assert "checkpoint saved to" in last and "Traceback" not in err


@pytest.mark.slow
@linux
@pytest.mark.parametrize("generators", ["0", "1"])
def test_a_file_size_limit_below_a_checkpoint_is_named_before_the_first_round(generators, tmp_path,
                                                                              tiny_path):
    """ulimit -f 200000 (a real RLIMIT_FSIZE): no checkpoint of the demo fits (its optimizer state
    is 753,664 bytes), so the run says so at once, in one line, instead of after its rounds (the
    synchronous loop) or about the wrong file (the async trainer, whose shared weights hit it)."""
    run = tmp_path / "run"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))    # noqa: E731
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *SMALL,
                           "--generators", generators, "--output-dir", str(run)],
                          capture_output=True, text=True, timeout=300, preexec_fn=limit)
    err = [line for line in done.stderr.strip().splitlines() if "publisher trust" not in line]
    assert done.returncode == 1 and len(err) == 1, done.stderr
    assert "may write no file over 200000 bytes" in err[0] and "optimizer state takes" in err[0]
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.slow
@linux
def test_no_worker_generates_while_the_trainer_evaluates(tmp_path, tiny_path):
    """The wall clock stops for evals; the workers are held then. So one worker's generation
    seconds never exceed the run's wall seconds (evals every round, each longer than a round)."""
    run = str(tmp_path / "run")
    proc = start(run, "--max-rounds", "24", "--eval-every", "1", "--eval-prompts", "200",
                 "--new-per-update", "16")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    steps = [r for r in rows_safe(run) if "is_ratio_mean" in r]
    assert steps and all(r["gen_seconds"] <= r["wall_seconds"] + 0.05 for r in steps), \
        [(r["gen_seconds"], r["wall_seconds"]) for r in steps]
    evals = [r for r in rows(run) if "eval_accuracy" in r]
    assert evals[-1]["eval_seconds"] > steps[-1]["gen_seconds"]     # the evals would have fed it


def waiting(pid: int) -> bool:
    """Whether a worker's main thread sleeps in the kernel (a worker waiting for an order)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


@pytest.mark.slow
@linux
def test_one_stopped_worker_does_not_stop_the_others(tmp_path, tiny_path):
    """Issue 69, item 16: with 2 workers a SIGSTOP of one stopped the other too (0 rounds in 20 s):
    stopped while it waited for an order, it held the lock of the queue they shared. Each worker
    has its own queue now: the other goes on generating and the trainer on training; a Ctrl-C
    then saves the run and ends both."""
    run = str(tmp_path / "run")
    # K = 8: the trainer is the slower, so a worker mostly waits for an order
    proc = start(run, "--generators", "2", "--max-rounds", "100000", "--worker-timeout", "0",
                 "--eval-every", "1000", "--buffer-size", "64", "--updates-per-round", "8")
    try:
        wait_for_step(run, proc, steps=2)
        stalled, _ = workers(proc.pid)
        while not waiting(stalled):             # stopped while it waits for an order
            time.sleep(0.001)
        stop_for_good(stalled)
        before = max(r["round"] for r in rows_safe(run))
        time.sleep(20)
        after = max(r["round"] for r in rows_safe(run))
        assert after - before >= 3, (before, after)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGINT, err
        assert f"resume with: python train.py --resume {run}" in err
        assert session_gone(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


SLOW_START = """
import sys, time
if "spawn_main" in " ".join(getattr(sys, "orig_argv", [])):   # a generation worker's interpreter
    ready = time.process_time() + {seconds}
    while time.process_time() < ready:      # a start-up that works: imports on a loaded machine
        pass
"""


def start_slowly(tmp_path, run, seconds, *flags):
    """train.py --generators 1 whose worker's interpreter spends ``seconds`` of CPU time starting
    (a sitecustomize.py, run before anything of ours), in a session of its own."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_START.format(seconds=seconds))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(site)}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *SMALL,
                             "--output-dir", run, "--generators", "1", *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow
@linux
def test_a_worker_still_starting_is_not_called_hung(tmp_path, tiny_path):
    """Issue 69, item 12: --worker-timeout counted a worker's start-up, so a healthy worker still
    importing was called "stopped (SIGSTOP, a debugger) or hung". A real worker whose start-up
    takes 6 s of CPU time, --worker-timeout 3: the run finishes."""
    run = str(tmp_path / "run")
    proc = start_slowly(tmp_path, run, 6, "--max-rounds", "3", "--worker-timeout", "3")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert final_state(run)["round"] == 3


@pytest.mark.slow
@linux
def test_a_worker_stopped_while_starting_is_still_named(tmp_path, tiny_path):
    """Its start-up's CPU time is its sign of life: stopped (SIGSTOP) while it starts, it uses
    none, and --worker-timeout names it, the run saved, nothing left."""
    run = str(tmp_path / "run")
    proc = start_slowly(tmp_path, run, 60, "--max-rounds", "3", "--worker-timeout", "3")
    try:
        deadline = time.monotonic() + 60
        while not (found := workers(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(found[0], signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert (f"generation worker 0 (pid {found[0]}) gave no sign of life for" in last
                and "(--worker-timeout 3) while starting (no CPU time used): stopped" in last), err
        assert session_gone(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def memory_cgroup(name: str, limit: int) -> str | None:
    """A new memory cgroup of ``limit`` bytes (no swap) under this process's own, cgroup v1 or v2,
    or None where this process may not make one."""
    for line in open("/proc/self/cgroup"):
        number, controllers, path = line.rstrip("\n").split(":", 2)
        if "memory" in controllers.split(","):
            folder = f"/sys/fs/cgroup/memory{path}/{name}"
            settings = {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
        elif number == "0" and os.path.exists(f"/sys/fs/cgroup{path}/memory.max"):
            folder = f"/sys/fs/cgroup{path}/{name}"
            settings = {"memory.max": limit, "memory.swap.max": 0}
        else:
            continue
        try:
            os.mkdir(folder)
            for file, value in settings.items():
                if os.path.exists(os.path.join(folder, file)):      # no swap accounting: none
                    with open(os.path.join(folder, file), "w") as f:
                        f.write(str(value))
            return folder
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
    return None


@pytest.mark.slow
@linux
def test_a_worker_the_oom_killer_ends_is_named_as_memory(tmp_path, tiny_path):
    """Issue 69, item 11: a worker the OOM killer ended was "killed by SIGKILL", nothing about
    memory. A real OOM kill: the worker moved into a memory cgroup of 1 MiB, where its next
    allocations find no room. The line says memory, the run is saved, nothing left."""
    cgroup = memory_cgroup(f"replay-rl-oom-{os.getpid()}", 1 << 20)
    if cgroup is None:
        pytest.skip("no memory cgroup this process may make here (cgroup v1 or v2, written)")
    run = str(tmp_path / "run")
    proc = start(run, "--max-rounds", "100000")
    try:
        wait_for_step(run, proc, steps=1)
        (worker,) = workers(proc.pid)
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(worker))
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert (f"generation worker 0 (pid {worker}) killed by SIGKILL: out of memory, most "
                "likely (the kernel's OOM killer ended") in last, err
        assert "checkpoint saved to" in last
        assert session_gone(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(cgroup) and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                os.rmdir(cgroup)
            time.sleep(0.1)
