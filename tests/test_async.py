"""--generators W (async_rl.py): worker processes generate while the trainer steps.

Exact where it can be (--lockstep is the synchronous loop, metric for metric); nothing generated
is thrown away; S keeps its meaning; a worker that fails stops the run after a checkpoint, with
one line naming it; a Ctrl-C to the whole process group saves; --resume continues; no process of
the run is left alive, whatever ends it."""
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import async_rl
from infra import workers as worker_processes
from infra import checkpoint
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts-per-round", "4", "--num-generations", "4", "--buffer-size", "16",
         "--batch-size", "16", "--eval-prompts", "20", "--eval-every", "2", "--seed", "3",
         "--no-progress", "--no-plot"]
TIMINGS = ("_seconds", "_frac", "_per_s")


def rows(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def without_timings(run):
    """Its step and eval rows, timings aside (an async run also writes a row for each round)."""
    return [{k: v for k, v in r.items() if not k.endswith(TIMINGS)} for r in rows(run)
            if r.get("updates") != 0]


def final_state(run):
    with open(os.path.join(checkpoint.find(run), "state.json")) as f:
        return json.load(f)["state"]


@pytest.mark.slow
def test_lockstep_is_the_synchronous_loop_metric_for_metric(tmp_path, tiny_path):
    """Worker 0 is seeded as the synchronous process, the trainer draws the prompts and waits for
    the weights of every step: the same samples, the same steps, the same evals; every rollout
    trained at age 0 with rho = 1 (within 1e-5). Both runs on the threads each process of the
    lockstep run gets (as many threads, as many ways to sum: under `pytest -n 2` one, alone two)."""
    import torch
    sync, lockstep = str(tmp_path / "sync"), str(tmp_path / "lockstep")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(worker_processes.threads_each(1, "cpu"))
        train.main(SMALL + ["--max-rounds", "4", "--output-dir", sync])
        train.main(SMALL + ["--max-rounds", "4", "--output-dir", lockstep, "--generators", "1",
                            "--lockstep"])
    finally:
        torch.set_num_threads(threads)
    assert without_timings(lockstep) == without_timings(sync)
    steps = [r for r in rows(lockstep) if "is_ratio_max" in r]
    assert len(steps) == 4
    for r in steps:
        assert r["age_max"] == 0 and abs(r["is_ratio_max"] - 1) < 1e-5
        assert r["trainer_wait_frac"] > 0       # the async figures are there, measured


@pytest.mark.slow
def test_async_on_policy_uses_each_rollout_once_and_replay_throws_nothing_away(tmp_path, tiny_path):
    """S = B = N: every stored rollout trained on exactly once (none evicted unused).
    --step-when-held (the paper's sampler): every generated rollout stored, none evicted before its
    first use (the worker waits for room instead), the trainer steps on whatever the buffer holds."""
    on_policy, replay = str(tmp_path / "on"), str(tmp_path / "replay")
    train.main(SMALL + ["--max-rounds", "6", "--output-dir", on_policy, "--generators", "1",
                        "--new-per-update", "16"])
    state = final_state(on_policy)
    assert state["rollouts_generated"] == state["rollouts_stored"] == 6 * 16
    assert state["rollouts_trained"] == state["rollouts_stored"] == state["step"] * 16
    assert state["left_by_uses"] in ([0, 80], [0, 80, 0])   # the last 16 still in the buffer
    assert state["age_max"] <= 1            # generated while the trainer took one step at most

    train.main(SMALL + ["--max-rounds", "6", "--output-dir", replay, "--generators", "1",
                        "--step-when-held", "--buffer-size", "32", "--max-uses", "0"])   # uncapped
    state = final_state(replay)
    assert state["rollouts_generated"] == state["rollouts_stored"] == 6 * 16
    assert state["left_by_uses"][0] == 0 and sum(state["left_by_uses"]) == 6 * 16 - 32
    assert state["rollouts_trained"] == state["step"] * 16 >= 16


def test_the_loop_rules_with_a_stand_in_buffer():
    """The steps a round makes due, as in the synchronous loop: K once the buffer holds B (S = 0),
    K for every S new ones (here 3 rounds of 16 at S = 8: 2 steps each), one with
    --step-when-held; the trainer's room rule counts unused rollouts and those on their way."""
    from types import SimpleNamespace
    from buffer import ReplayBufferWithVariants, Rollout
    import torch

    cfg = SimpleNamespace(new_per_update=8, updates_per_round=1, lockstep=False, batch_size=16,
                          buffer_size=32, rollouts_per_round=16, num_generations=4,
                          max_rounds=3, max_gen_tokens=0, step_when_held=False)
    state = train.LoopState()
    written = []
    run = SimpleNamespace(cfg=cfg, state=state, buffer=ReplayBufferWithVariants(32),
                          reporter=SimpleNamespace(row=lambda state, row: written.append(row)))
    one = lambda: Rollout(torch.tensor([1]), torch.tensor([2]), torch.tensor([-0.5]), 1.0, 0.5, 0,
                          baseline=0.5, temperature=1.0)
    gen = {"new_tokens": 16, "reward": 1.0, "zero_adv_frac": 0.0, "rollout_entropy": 0.1,
           "completion_len": 1.0, "truncated_frac": 0.0, "reward_errors": 0}
    assert async_rl.room_for_a_round(run, outstanding=1)         # 2 x 16 fit in 32
    assert not async_rl.room_for_a_round(run, outstanding=2)     # 3 x 16: the first evicted
    assert async_rl.store(run, [one() for _ in range(16)], gen) == 2        # S = 8: 16 / 8 = 2
    assert state.new_since_step == 0 and state.round == 1
    assert written[-1]["updates"] == 0 and written[-1]["buffer_fill"] == 16    # the round's row
    assert async_rl.room_for_a_round(run, outstanding=0)         # 16 + 16 fit
    assert not async_rl.room_for_a_round(run, outstanding=1)     # would evict 16 unused
    run.buffer.items[0].uses = 1
    run.buffer.items[-1].uses = 1
    assert not async_rl.room_for_a_round(run, outstanding=1)     # FIFO: the oldest 16 leave
    for r in run.buffer.items:
        r.uses = 1
    assert async_rl.room_for_a_round(run, outstanding=1)
    cfg.new_per_update, cfg.updates_per_round = 0, 3             # S = 0: K a round, once B held
    assert async_rl.store(run, [one() for _ in range(16)], gen) == 3
    cfg.step_when_held, cfg.updates_per_round = True, 1          # the paper's: one, then on
    assert async_rl.store(run, [one() for _ in range(16)], gen) == 1
    run.buffer.items = run.buffer.items[:8]
    cfg.step_when_held = False
    assert async_rl.store(run, [], gen) == 0 and state.idle_rounds == 1    # fewer than B held


def test_with_s_no_step_is_made_due_before_the_buffer_holds_b():
    """S = 8, B = 32: a first round of 16 made 2 steps due that one_step could not take (fewer than
    B held), counted as lapsed; the synchronous loop takes none before it holds B. Now: 0, an idle
    round; the round that brings B makes 16 / 8 = 2 due (what filled the buffer before does not
    count toward S)."""
    from types import SimpleNamespace
    from buffer import ReplayBufferWithVariants, Rollout
    import torch

    cfg = SimpleNamespace(new_per_update=8, updates_per_round=1, batch_size=32, num_generations=4,
                          step_when_held=False)
    state = train.LoopState()
    run = SimpleNamespace(cfg=cfg, state=state, buffer=ReplayBufferWithVariants(64),
                          reporter=SimpleNamespace(row=lambda state, row: None))
    gen = {"new_tokens": 16, "reward": 1.0, "zero_adv_frac": 0.0, "rollout_entropy": 0.1,
           "completion_len": 1.0, "truncated_frac": 0.0, "reward_errors": 0}
    round_ = lambda: [Rollout(torch.tensor([1]), torch.tensor([2]), torch.tensor([-0.5]), 1.0, 0.5,
                              0, baseline=0.5, temperature=1.0) for _ in range(16)]
    assert async_rl.store(run, round_(), gen) == 0 and state.idle_rounds == 1
    assert async_rl.store(run, round_(), gen) == 2 and state.new_since_step == 0


def test_the_trainer_orders_a_batch_of_rounds_ahead_so_a_step_never_starves_the_worker():
    """The trainer orders only between steps: before a step it must have ordered every round the
    worker can generate during it. R = 4, B = 16, N = 32, S = 0, one worker, every stored rollout
    used: room for 8 rounds, and 1 + 16/4 = 5 are ordered (two, before: a step fed by four rounds
    left the worker idle for part of it); R = B = 16: 1 + 1 = 2. Orders stop at the budget."""
    import random
    import types
    from buffer import ReplayBuffer, Rollout
    import torch

    def ordered(R, B, max_rounds=100):
        cfg = types.SimpleNamespace(generators=1, batch_size=B, rollouts_per_round=R, buffer_size=32,
                                    new_per_update=0, lockstep=False, prompts_per_round=R // 4,
                                    max_rounds=max_rounds, max_gen_tokens=0, step_when_held=False)
        run = types.SimpleNamespace(cfg=cfg, state=train.LoopState(), buffer=ReplayBuffer(32),
                                    rng=random.Random(0),
                                    task=types.SimpleNamespace(train_prompts=list("abcdefgh")))
        run.buffer.add([Rollout(torch.tensor([1]), torch.tensor([2]), torch.tensor([-0.5]), 1.0,
                                0.5, 0, baseline=0.5, temperature=1.0) for _ in range(32)])
        for r in run.buffer.items:
            r.uses = 1
        generators = worker_processes.Generators(run, async_rl.worker_loop)
        generators.trainer_step = types.SimpleNamespace(value=0)
        generators.orders = types.SimpleNamespace(put=lambda prompts: None)
        async_rl.order_rounds(run, generators)
        return generators.outstanding

    assert ordered(R=4, B=16) == 5
    assert ordered(R=16, B=16) == 2
    assert ordered(R=4, B=16, max_rounds=3) == 3


def reward_file(tmp_path, body):
    """A --reward file whose misbehaviour a marker file switches on (so a resume can go on)."""
    marker = tmp_path / "misbehave"
    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        import tasks
        ADD = tasks.addition_task(2).reward
        calls = [0]

        def reward(prompt, completion):
            calls[0] += 1
            if os.path.exists({str(marker)!r}) and calls[0] > 40:
        """) + textwrap.indent(textwrap.dedent(body), " " * 8)
                    + "    return ADD(prompt, completion)\n")
    marker.write_text("on")
    return f"{path}:reward", marker


def start(run, *flags):
    """train.py in a session of its own (its own process group, as a terminal gives a job)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REPLAY_RL_STOP_GRACE": "60"}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *SMALL,
                             "--output-dir", run, "--generators", "1", *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def session(sid: int) -> list[int]:
    """The live processes of session sid (zombies aside): start() gives the run a session of its
    own, and each worker leads a process group of its own within it."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(name))
    return found


def session_gone(sid: int, within: float = 10.0) -> bool:
    """Whether every process of the session has ended (within a few seconds)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not session(sid):
            return True
        time.sleep(0.05)
    return False


def running(tmp_path, *flags, steps=1):
    """(run folder, process): train.py started (start) and past its first steps."""
    run = str(tmp_path / "run")
    proc = start(run, *flags)
    wait_for_step(run, proc, steps)
    return run, proc


def resume(run, *flags, timeout=600):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--resume", run, *flags],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_step(run, proc, steps=1, within=120):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(os.path.join(run, "metrics.jsonl")):
            if sum("is_ratio_mean" in r for r in rows_safe(run)) >= steps:
                return
        time.sleep(0.1)
    raise AssertionError(f"no step {steps} within {within} s: {proc.poll()} {proc.stderr.read()}")


def rows_safe(run):
    try:
        return rows(run)
    except ValueError:          # a line being written
        return []


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def workers(pid):
    """The trainer's generation workers (not multiprocessing's resource tracker), oldest first."""
    found = []
    for child in children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                found.append(child)
    return sorted(found)


FAULTS = [("a reward that raises", "raise ValueError('bad reward')\n",
           "generation worker 0 failed: the reward function failed"),
          ("a reward past --reward-timeout", "time.sleep(30)\n", "took longer than 1 s")]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, process groups")
@pytest.mark.parametrize("what, body, says", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_failing_worker_stops_the_run_after_a_checkpoint_and_resume_goes_on(
        what, body, says, tmp_path, tiny_path):
    run = str(tmp_path / "run")
    reward, marker = reward_file(tmp_path, body)
    proc = start(run, "--max-rounds", "30", "--reward", reward, "--reward-timeout", "1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert says in last and "checkpoint saved to" in last, err
    assert f"resume with: python train.py --resume {run}" in last
    assert "Traceback" not in err
    assert session_gone(proc.pid)
    saved = final_state(run)
    assert 0 < saved["round"] < 30
    marker.unlink()                             # the reward behaves now: the run goes on
    done = resume(run, "--max-rounds", str(saved["round"] + 2))
    assert done.returncode == 0, done.stderr
    assert final_state(run)["round"] == saved["round"] + 2


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, process groups")
def test_a_worker_killed_stops_the_run_with_one_line_naming_it(tmp_path, tiny_path):
    run, proc = running(tmp_path, "--max-rounds", "400")
    (worker,) = workers(proc.pid)
    os.kill(worker, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert f"generation worker 0 (pid {worker}) killed by SIGKILL" in err.strip().splitlines()[-1]
    assert checkpoint.find(run) is not None
    assert session_gone(proc.pid)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, process groups")
def test_ctrl_c_to_the_process_group_saves_and_resume_finishes_the_run(tmp_path, tiny_path):
    """What a terminal sends: SIGINT to every process of the job. The workers ignore it, the
    trainer stops them, saves and exits 130; nothing of the run is left; --resume finishes."""
    run, proc = running(tmp_path, "--max-rounds", "60", steps=2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert f"resume with: python train.py --resume {run}" in err
    assert "Traceback" not in err
    assert session_gone(proc.pid)
    saved = final_state(run)
    assert 0 < saved["round"] < 60
    done = resume(run, "--progress")
    assert done.returncode == 0, done.stderr
    assert final_state(run)["round"] == 60
    assert "async: 1 worker(s)" in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, PR_SET_PDEATHSIG")
def test_no_worker_outlives_a_trainer_killed_with_sigkill(tmp_path, tiny_path, capsys):
    """No worker outlives it; its launcher folder ($TMPDIR/replay-rl-<pid>-*, which it could not
    remove) is removed by the next trainer that starts workers, which says so (issue 69, 6)."""
    import glob
    import tempfile
    from infra import stopping
    run, proc = running(tmp_path, "--max-rounds", "400")
    assert children(proc.pid)                   # the worker
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert session_gone(proc.pid)
    left = glob.glob(os.path.join(tempfile.gettempdir(), f"replay-rl-{proc.pid}-*"))
    assert len(left) == 1 and os.path.exists(os.path.join(left[0], "worker-python"))
    assert left[0] in stopping.remove_launchers_left()       # what the next start runs first
    assert not os.path.exists(left[0]) and "removed 1 launcher folder" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, /proc")
@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_two_ctrl_cs_while_the_workers_start_exit_at_once_and_leave_nothing(tmp_path, tiny_path,
                                                                             delay):
    """What a terminal sends at two quick Ctrl-Cs, to the whole group, as the trainer starts its
    worker (its launcher folder just made, then 0.3 s later): both notices, exit 130 without a
    traceback, no process and no launcher folder left (issue 69, item 13)."""
    import glob
    import tempfile
    run = str(tmp_path / "run")
    proc = start(run, "--max-rounds", "400")
    folder = os.path.join(tempfile.gettempdir(), f"replay-rl-{proc.pid}-*")
    deadline = time.monotonic() + 120
    while not glob.glob(folder) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert glob.glob(folder), proc.poll()
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "SIGINT: stopping to save a checkpoint" in err and "interrupted again" in err, err
    assert "Traceback" not in err and "EOFError" not in err, err
    assert session_gone(proc.pid)
    assert glob.glob(folder) == []


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not sys.platform.startswith("linux"),
                    reason="POSIX named semaphores in /dev/shm, process groups")
def test_a_sigkill_to_the_process_group_leaves_semaphores_that_the_next_start_unlinks(
        tmp_path, tiny_path, capsys):
    """systemd, Slurm and docker kill send SIGKILL to every process of the run: multiprocessing's
    resource tracker dies with it and cannot unlink the workers' named semaphores. The launcher
    folder lists them; the next trainer that starts workers unlinks them and says so (issue 69,
    item 7)."""
    import glob
    import tempfile
    from infra import stopping
    run, proc = running(tmp_path, "--max-rounds", "400")
    (folder,) = glob.glob(os.path.join(tempfile.gettempdir(), f"replay-rl-{proc.pid}-*"))
    names = open(os.path.join(folder, stopping.SEMAPHORES)).read().split()
    shm = lambda name: os.path.join("/dev/shm", "sem." + name.lstrip("/"))     # noqa: E731
    # the workers' queues (3 each: orders, results), lock and shared values (1 each)
    assert len(names) == 3 * 2 + 5 and all(os.path.exists(shm(name)) for name in names)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert session_gone(proc.pid)
    assert all(os.path.exists(shm(name)) for name in names)        # left: the tracker died too
    assert folder in stopping.remove_launchers_left()               # what the next start runs
    assert not any(os.path.exists(shm(name)) for name in names)
    assert f"and {len(names)} semaphore(s) in /dev/shm" in capsys.readouterr().err


REFUSALS = [(["--lockstep"], "--lockstep: only with --generators 1 or more"),
            (["--max-lag", "1"], "--max-lag: only with --generators 1 or more"),
            (["--generators", "1", "--keep-correct-frac", "0.25"],
             "--keep-correct-frac 0.25 with --generators"),
            (["--generator-devices", "cpu"], "--generator-devices: only with --generators"),
            (["--generators", "-1"], "--generators -1: must be >= 0"),
            (["--generators", "1", "--sync-every", "0"], "--sync-every 0: must be > 0"),
            (["--generators", "1", "--buffer-size", "64", "--batch-size", "64",
              "--new-per-update", "64"], "every round is stored whole"),
            (["--generators", "1", "--lockstep", "--sync-every", "2"], "--lockstep"),
            (["--step-when-held"], "--step-when-held: only with --generators"),
            (["--generators", "1", "--step-when-held", "--updates-per-round", "2"],
             "--step-when-held: the trainer steps whenever B are held"),
            (["--generators", "1", "--sync-every", "4", "--max-lag", "1"],
             "--max-lag 1 without --step-when-held"),
            (["--generators", "1", "--step-when-held", "--max-lag", "2"],
             "--max-lag 2 with --sync-every 1: never waits"),
            (["--generators", "1", "--step-when-held", "--sync-every", "4", "--max-lag", "3"],
             "never waits")]


@pytest.mark.parametrize("flags, says", REFUSALS, ids=[" ".join(f) for f, _ in REFUSALS])
def test_async_flags_that_cannot_work_are_refused_in_one_line(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_config(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err


def test_ctrl_c_while_the_libraries_load_is_one_line(tmp_path):
    """A Ctrl-C in the first second of `python train.py` (torch and transformers still importing,
    nothing of the run written): one line, no traceback."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--output-dir",
                             str(tmp_path / "run")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.15)            # torch takes seconds to import: the signal lands in the imports
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines() == ["interrupted while starting: nothing saved"]
    assert not (tmp_path / "run").exists()


def test_a_worker_past_max_lag_waits_for_the_next_publish_and_not_at_the_bound():
    """WorkerLink.load_weights alone: weights published at step 4, the trainer at step 6 (2 behind).
    --max-lag 1 waits until the next publish (step 8, 0.3 s later) and loads it; --max-lag 2 takes
    version 4 at once."""
    import threading
    import types
    import torch

    def link(max_lag, version, trainer_step, weights):
        return worker_processes.WorkerLink(0, None, None, weights, version, trainer_step,
                                           threading.Lock(), os.getppid(),
                                           types.SimpleNamespace(max_lag=max_lag))

    def values():
        return types.SimpleNamespace(value=4), types.SimpleNamespace(value=6), torch.zeros(3)

    version, trainer_step, weights = values()
    at_bound, model = link(2, version, trainer_step, weights), torch.nn.Linear(1, 3, bias=False)
    assert at_bound.load_weights(model) == 4 and at_bound.times[0] < 0.1
    assert torch.equal(model.weight.detach().flatten(), torch.zeros(3))

    version, trainer_step, weights = values()
    past = link(1, version, trainer_step, weights)

    def publish():                               # the trainer's step 8: new weights, then the version
        time.sleep(0.3)
        weights.fill_(1.0)
        trainer_step.value = version.value = 8
    threading.Thread(target=publish).start()
    assert past.load_weights(model) == 8
    assert past.times[0] >= 0.25                 # it waited, booked as waiting for weights
    assert torch.equal(model.weight.detach().flatten(), torch.ones(3))


def hold_the_lock_and_die(lock):
    """A worker killed (SIGKILL) while it copies the published weights: their lock stays held."""
    lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, SIGKILL")
def test_a_worker_killed_holding_the_weights_lock_ends_publish_in_one_line_not_a_hang():
    """Generators.publish alone: the only worker died holding the lock. publish raises WorkerFailed
    naming it (killed by SIGKILL) within seconds; before, it waited on the lock for ever."""
    import multiprocessing
    import threading
    import types
    import torch
    ctx = multiprocessing.get_context("fork")
    gens = worker_processes.Generators.__new__(worker_processes.Generators)
    gens.cfg = types.SimpleNamespace(worker_timeout=0)
    gens.oom_kills = None                               # the OOM killer's count: not known
    gens.lock, gens.results = ctx.Lock(), ctx.Queue()
    gens.beats, gens.resumed_at = [time.monotonic()], time.monotonic()
    gens.weights, gens.version, gens.trainer_step = torch.zeros(3), ctx.Value("q", -1), ctx.Value("q", 0)
    dead = ctx.Process(target=hold_the_lock_and_die, args=(gens.lock,))
    dead.start()
    dead.join(10)
    assert dead.exitcode == -signal.SIGKILL
    gens.procs = [dead]
    model, raised = torch.nn.Linear(1, 3, bias=False), []

    def publish():
        try:
            gens.publish(model, 5)
        except worker_processes.WorkerFailed as e:
            raised.append(str(e))
    t = threading.Thread(target=publish, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "publish hung on the dead worker's lock"
    assert raised == [f"generation worker 0 (pid {dead.pid}) killed by SIGKILL"]
    assert gens.version.value == -1                     # nothing published


def test_a_resumed_full_buffer_of_unused_rollouts_still_orders_a_round():
    """A resume with --step-when-held whose buffer holds B or more, some unused: no step may be
    taken until a round has arrived (one_step waits for delivered), and the room rule forbade an
    order (it would evict unused ones). The trainer waited for a round never ordered (a CI run hung
    on test_async_faults' resume test). With nothing on its way and no step possible, it orders."""
    from types import SimpleNamespace
    from buffer import ReplayBufferWithVariants, Rollout
    import torch

    cfg = SimpleNamespace(generators=1, batch_size=16, buffer_size=32, rollouts_per_round=16,
                          max_rounds=10, max_gen_tokens=0, step_when_held=True, lockstep=False,
                          prompts_per_round=2)
    buffer = ReplayBufferWithVariants(32)
    buffer.add([Rollout(torch.tensor([1]), torch.tensor([2]), torch.tensor([-0.5]), 1.0, 0.5, 0,
                        baseline=0.5, temperature=1.0) for _ in range(32)])   # none used yet
    ordered = []
    workers = SimpleNamespace(outstanding=0, delivered=False, published=0,
                              trainer_at=lambda step: None,
                              order=lambda prompts: (ordered.append(prompts),
                                                     setattr(workers, "outstanding", 1)))
    run = SimpleNamespace(cfg=cfg, state=train.LoopState(), buffer=buffer,
                          rng=random.Random(0), task=SimpleNamespace(train_prompts=["1+1="] * 4))
    assert not async_rl.room_for_a_round(run, outstanding=0)      # it would evict unused ones
    async_rl.order_rounds(run, workers)
    assert len(ordered) == 1                                       # ordered anyway: none arrived
    workers.outstanding, workers.delivered, ordered[:] = 0, True, []
    async_rl.order_rounds(run, workers)
    assert ordered == []            # once a round has arrived, the trainer steps on what it holds
