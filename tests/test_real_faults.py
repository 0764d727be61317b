"""Faults the operating system makes, not stand-ins: a file size limit (RLIMIT_FSIZE: writes fail
with EFBIG, as on a full disk) and a real 2 MB tmpfs, met by each file a run writes; a lock whose
holder is SIGKILLed while a child it forked lives on; a save of a round already saved, killed
(os._exit) after each of its steps; a GGUF conversion stopped half-way; rewards that return NumPy
or torch scalars, or that defeat the time limit."""
import contextlib
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
from infra import pretrained
from infra import runfolder
import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}

# Each case runs in a process forked from one Python (torch imported once): it writes its file
# once, then sets the limit and writes it again, too large: past a file size limit (setrlimit;
# SIGXFSZ ignored, so that the write fails with EFBIG instead of killing the process) or on a disk
# filled but for its last 200 kB. Its stderr is what a user would see: train.py and evaluate.py
# end with sys.exit(message), printed here as Python would (metrics.jsonl's case exits for real,
# closing its open file as Python does).
WRITERS = textwrap.dedent(r"""
    import contextlib, json, os, random, resource, shutil, signal, sys, types
    import torch
    from safetensors.torch import save_file
    import evaluate
    from infra import checkpoint, curves, report, runfolder, stopping

    results, cases = sys.argv[1], [arg.split(":", 2) for arg in sys.argv[2:]]   # limit:folder:name
    BIG = 100_000                       # floats: 400 kB, past the limit (200 kB)
    CHECKPOINT = ("buffer.safetensors", "rng.safetensors", "adapter", "optimizer.pt", "state.json")

    class Adapter:                      # a LoRA adapter as PEFT writes it
        def __init__(self, n):
            self.n = n
        def save_pretrained(self, folder):
            os.makedirs(folder, exist_ok=True)
            weights = os.path.join(folder, "adapter_model.safetensors")
            save_file({"lora_A": torch.ones(self.n)}, weights)
            with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                json.dump({"r": 1}, f)

    checkpoint.buffer_state = lambda buffer: buffer.state_dict()     # the stand-in's own, below
    class Buffer:                       # one rollout of n prompt tokens, as buffer_state saves it
        def __init__(self, n, sampler=True):
            self.n, self.sampler = n, sampler
        def state_dict(self):
            one = lambda dtype: torch.zeros(1, dtype=dtype)
            return {"prompt_ids": torch.zeros(self.n, dtype=torch.long),
                    "prompt_lens": torch.tensor([self.n]), "completion_ids": one(torch.long),
                    "completion_lens": torch.tensor([1]), "behaviour_logp": one(torch.float32),
                    **{k: one(torch.float64) for k in ("reward", "advantage", "baseline")},
                    "policy_version": one(torch.long), "uses": one(torch.long),
                    **({"generator_state": torch.Generator().get_state()} if self.sampler else {})}

    def save(run, round, big=""):
        n = lambda part: BIG if part == big else 10
        param = torch.nn.Parameter(torch.zeros(n("optimizer.pt")))
        optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
        param.grad = torch.ones_like(param)
        optimizer.step()
        note = "x" * (4 * BIG if big == "state.json" else 1)
        checkpoint.save(run, {"round": round, "step": round},
                        {"batch_size": 4, "keep_checkpoints": 2, "note": note},
                        model=Adapter(n("adapter")),
                        optimizer=optimizer,
                        # the rng case's limit, 2 kB: its buffer file must be smaller (without its
                        # 5 kB sampler state; that checkpoint is never whole, never read)
                        buffer=Buffer(n("buffer.safetensors"), sampler=big != "rng.safetensors"),
                        rng=random.Random(0))

    def limit(folder, size=200_000):
        if kind == "fsize":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))
        else:                           # fill the disk but for `size` bytes
            disk = os.statvfs(folder)
            filler = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT)
            os.write(filler, b"\0" * max(0, disk.f_bavail * disk.f_frsize - size))
            os.close(filler)

    @contextlib.contextmanager
    def unlimited():                    # for the test's own files
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    def listing(run):
        return sorted(os.path.relpath(os.path.join(d, f), run) for d, subs, files in os.walk(run)
                      for f in files + subs if f != "filler")

    def case(name, run, result):
        if name in CHECKPOINT:
            save(run, 2)
            limit(run, 2000 if name == "rng.safetensors" else 200_000)    # rng: 5 kB
            try:
                save(run, 4, big=name)
            except runfolder.DiskFull as e:
                result["listing"] = listing(run)
                result["resumes_from"] = checkpoint.read(checkpoint.find(run)).state["round"]
                sys.exit(f"error: {stopping.disk_full_message(e)}")
        elif name in (".lock", "config.json"):     # a disk full from the start
            limit(run, 0 if name == ".lock" else 200_000)
            try:
                if name == ".lock":
                    runfolder.lock_folder(run)
                else:
                    report.save_config(run, {"note": "x" * 4 * BIG})
            except runfolder.DiskFull as e:
                result["listing"] = listing(run)
                sys.exit(f"error: {stopping.disk_full_message(e)}")
        elif name == "metrics.jsonl":
            cfg = types.SimpleNamespace(plot=False, report_to="none", progress=False, max_rounds=1)
            state = types.SimpleNamespace(**dict.fromkeys(report.COUNTERS, 0))
            log = report.Report(run, cfg, state, resumed=False)
            log.row(state, {"eval_accuracy": 0.5})
            limit(run)
            try:
                log.row(state, {"note": "x" * 4 * BIG})
            except runfolder.DiskFull as e:
                result["listing"] = listing(run)
                sys.exit(f"error: {stopping.disk_full_message(e)}")
        elif name == "final adapter":
            checkpoint.save_adapter(Adapter(10), os.path.join(run, "adapter"))
            limit(run)
            try:
                checkpoint.save_adapter(Adapter(BIG), os.path.join(run, "adapter"))
            except runfolder.DiskFull as e:
                result["listing"] = listing(run)
                weights = os.path.join(run, "adapter", "adapter_model.safetensors")
                result["kept"] = os.path.getsize(weights)
                sys.exit(f"error: {stopping.disk_full_message(e)}")
        elif name == "eval.json":
            evaluate.write(os.path.join(run, "eval.json"), {"eval_accuracy": 0.5})
            limit(run)
            try:
                evaluate.write(os.path.join(run, "eval.json"), {"note": "x" * 4 * BIG})
            finally:
                result["listing"] = listing(run)
                result["kept"] = json.load(open(os.path.join(run, "eval.json")))
        elif name == "curves.png":
            open(os.path.join(run, "metrics.jsonl"), "w").close()
            curves.save(curves.new_figure("", (2, 2)), os.path.join(run, "curves.png"), dpi=20)
            whole = open(os.path.join(run, "curves.png"), "rb").read()
            limit(run, 20_000)
            report.Report.curves(types.SimpleNamespace(plot=True, run_dir=run))
            result["listing"] = listing(run)
            result["kept"] = open(os.path.join(run, "curves.png"), "rb").read() == whole
            return
        result["listing"] = listing(run)        # not reached when the limit stopped the write

    save(os.path.join(results, "warm"), 1)  # torch's first save imports more: once, here
    shutil.rmtree(os.path.join(results, "warm"))
    for kind, work, name in cases:
        run = os.path.join(work, name.replace(" ", "-"))
        os.makedirs(run)
        pid = os.fork()
        if pid == 0:
            err = os.open(os.path.join(results, f"{kind} {name}.err"), os.O_WRONLY | os.O_CREAT)
            os.dup2(err, 2)
            result, stop = {}, None
            try:
                case(name, run, result)
            except SystemExit as e:
                stop = e
            finally:
                with unlimited(), open(os.path.join(results, f"{kind} {name}.json"), "w") as f:
                    json.dump(result, f)
            if stop and name == "metrics.jsonl":    # its open file, closed as Python exits
                raise stop
            if stop:
                with unlimited():
                    print(stop.code, file=sys.stderr, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        shutil.rmtree(run)              # room on the disk for the next case
""")

CHECKPOINT = ["buffer.safetensors", "rng.safetensors", "adapter", "optimizer.pt", "state.json"]
FILES = [".lock", "config.json", *CHECKPOINT, "metrics.jsonl", "final adapter", "eval.json",
         "curves.png"]


def run_writers(results, cases: list[tuple[str, str, str]]) -> dict:
    """{(limit, name): (its stderr, its result)} for each case (limit, folder, name): name's write
    past the limit ("fsize" or "disk"), in a folder of its own in ``folder``."""
    proc = subprocess.run([sys.executable, "-c", WRITERS, str(results), *map(":".join, cases)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for kind, _, name in cases:
        with open(os.path.join(results, f"{kind} {name}.json")) as f:
            err = open(os.path.join(results, f"{kind} {name}.err")).read()
            found[kind, name] = (err, json.load(f))
    return found


def check(name, err, result, limit_kind, run_dir):
    """The case ended in one line naming the limit, the file and (for a run's files) the intact
    last checkpoint; nothing half-written was left."""
    if name == "curves.png":            # a figure is not worth a run: one warning, the old one kept
        assert err.count("\n") == 1 and err.startswith("warning: curves.png not drawn ("), err
        assert result["kept"] and not any(".tmp" in f for f in result["listing"]), result
        return
    reason = "the file size limit is reached" if limit_kind == "fsize" else "the disk is full"
    assert err.count("\n") == 1 and err.startswith(f"error: {reason}: "), err
    size = {"rng.safetensors": 2000, ".lock": 0}.get(name, 200_000)
    disk = os.path.dirname(run_dir)
    where = (f"(this process may write no file over {size} bytes)" if limit_kind == "fsize" else
             f"(no space left on the disk mounted at {disk}, which holds {run_dir})")
    assert where in err, err
    hidden = [f for f in result["listing"] if os.path.basename(f).startswith((".tmp", ".old"))]
    assert not hidden, result["listing"]
    if name in CHECKPOINT:
        assert os.path.join(run_dir, ".tmp-checkpoint-4", name) in err
        assert f"the last checkpoint, {os.path.join(run_dir, 'checkpoint-2')}, is intact" in err
        assert f"train.py --resume {run_dir}" in err
        assert result["resumes_from"] == 2 and "checkpoint-4" not in str(result["listing"])
    elif name in (".lock", "config.json", "metrics.jsonl"):
        assert f"{os.path.join(run_dir, name)} could not be written" in err
        fix = "raise it (ulimit -f)" if limit_kind == "fsize" else "free space"
        assert f"nothing of the run was saved yet: {fix} and start it again" in err    # (no config.json here)
        assert "config.json" not in result["listing"]         # the folder holds no run yet
    elif name == "final adapter":
        assert os.path.join(run_dir, ".tmp-adapter") in err and result["kept"] < 1000
    elif name == "eval.json":
        assert f"{os.path.join(run_dir, 'eval.json')} could not be written" in err
        assert result["kept"] == {"eval_accuracy": 0.5} and result["listing"] == ["eval.json"]


@contextlib.contextmanager
def small_disk(folder):
    """A real 2 MB tmpfs mounted on folder while in the block (root, and a system that lets it
    mount), or None."""
    folder.mkdir()
    mounted = not subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)],
                                 capture_output=True).returncode
    try:
        yield str(folder) if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


NO_TMPFS = "cannot mount a tmpfs here (needs root and a system that allows it)"


def check_all(limit_kind: str, work: str, results, cases) -> None:
    """check each case; every case that fails is named, not only the first."""
    failures = []
    for name in cases:
        try:
            run_dir = os.path.join(work, name.replace(" ", "-"))
            check(name, *results[limit_kind, name], limit_kind, run_dir)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_each_file_past_the_file_size_limit_is_one_line_and_leaves_nothing_half_written(tmp_path):
    results = run_writers(tmp_path, [("fsize", str(tmp_path), name) for name in FILES])
    check_all("fsize", str(tmp_path), results, FILES)


@pytest.mark.slow
def test_each_file_on_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path):
    cases = [name for name in FILES if name != "rng.safetensors"]   # 5 kB: past the size limit only
    with small_disk(tmp_path / "disk") as disk:
        if not disk:
            pytest.skip(NO_TMPFS)
        results = run_writers(tmp_path, [("disk", disk, name) for name in cases])
        check_all("disk", disk, results, cases)


@pytest.mark.slow
def test_train_py_on_a_2_mb_disk_exits_in_one_line_naming_the_disk(tmp_path, tiny_path):
    with small_disk(tmp_path / "disk") as disk:
        if not disk:
            pytest.skip(NO_TMPFS)
        run = os.path.join(disk, "run")
        proc = subprocess.run([sys.executable, "train.py", "--save-every", "2", "--max-rounds", "6",
                               "--eval-prompts", "20", "--no-progress", "--output-dir", run],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        line = proc.stderr.strip().splitlines()[-1]     # (libraries may warn on lines before it)
        assert line.startswith("error: the disk is full: ") and f"mounted at {disk}," in line, line
        last = checkpoint.find(run)
        assert f"the last checkpoint, {last}, is intact" in line
        assert not [f for f in os.listdir(run) if f.startswith((".tmp", ".old"))], os.listdir(run)
        checkpoint.read(last)


# ---- the run folder's lock -----------------------------------------------------------------
def test_the_lock_is_freed_when_its_holder_is_killed_though_a_child_it_forked_lives_on(tmp_path):
    folder = str(tmp_path / "run")
    code = textwrap.dedent(f"""
        import multiprocessing, time
        from infra import runfolder
        runfolder.lock_folder({folder!r})
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, text=True,
                              stdout=subprocess.PIPE)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(runfolder.RunFolderBusy, match=f"is being written by pid {holder.pid}"):
            runfolder.lock_folder(folder)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)                                   # still alive, holding the file open
        runfolder.lock_folder(folder)                      # free all the same
    finally:
        runfolder.unlock_runs()
        os.kill(child, signal.SIGKILL)


# ---- a round saved again, killed at any moment ---------------------------------------------
KILLED_SAVE = textwrap.dedent(r"""
    import json, os, random, shutil, sys
    import torch
    from safetensors.torch import save_file
    from buffer import ReplayBuffer
    from infra import checkpoint

    run, pristine = sys.argv[1], sys.argv[1] + ".pristine"

    class Adapter:
        def save_pretrained(self, folder):
            os.makedirs(folder, exist_ok=True)
            save_file({"lora_A": torch.zeros(2)}, os.path.join(folder, "adapter_model.safetensors"))

    def save(version):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        checkpoint.save(run, {"round": 1, "step": 1},
                        {"batch_size": 4, "keep_checkpoints": 1, "version": version},
                        model=Adapter(), optimizer=optimizer, buffer=ReplayBuffer(4),
                        rng=random.Random(0))

    save(1)                             # round 1 saved at the end of the round ...
    shutil.copytree(run, pristine)
    found = []
    for kill_after in range(1, 9):      # ... and again at the end of the run: killed after step k
        pid = os.fork()
        if pid == 0:
            steps = []
            def dying(real):
                def step(*args, **kwargs):
                    real(*args, **kwargs)
                    steps.append(args)
                    if len(steps) == kill_after:
                        os._exit(9)
                return step
            os.replace, os.rename = dying(os.replace), dying(os.rename)
            shutil.rmtree = dying(shutil.rmtree)
            save(2)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        path = checkpoint.find(run)
        saved = checkpoint.read(path) if path else None
        found.append([os.waitstatus_to_exitcode(status), path and os.path.basename(path),
                      saved and saved.config["version"], sorted(os.listdir(run))])
        shutil.rmtree(run)
        shutil.copytree(pristine, run)
    print(json.dumps(found))
""")


def test_a_round_saved_again_and_killed_after_any_step_leaves_a_complete_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, run], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found[0][0] == 9 and found[-1][0] == 0       # killed at its first step; the last ends
    for code, path, version, names in found:
        assert path == "checkpoint-1" and version in (1, 2), found
        assert not [n for n in names if n.startswith(".old")], found  # settled: nothing left aside
    assert found[-1][2] == 2


def test_a_kill_between_the_two_renames_is_completed_by_the_next_reader(tmp_path):
    run = tmp_path / "run"
    (run / ".old-checkpoint-3").mkdir(parents=True)         # the old one moved aside ...
    (run / ".old-checkpoint-3" / "state.json").write_text("{}")
    (run / ".tmp-checkpoint-3").mkdir()                     # ... the new one whole, not renamed in
    (run / ".tmp-checkpoint-3" / "state.json").write_text('{"new": 1}')
    assert runfolder.holds_run(str(run))
    assert checkpoint.find(str(run / "checkpoint-3")) == str(run / "checkpoint-3")
    assert sorted(os.listdir(run)) == ["checkpoint-3"]
    assert (run / "checkpoint-3" / "state.json").read_text() == '{"new": 1}'


# ---- a GGUF conversion stopped half-way ----------------------------------------------------
def test_an_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    monkeypatch.setenv("REPLAY_RL_CACHE", str(tmp_path / "cache"))

    def interrupted(path, folder):                          # Ctrl-C half-way through the writing
        os.makedirs(folder)
        open(os.path.join(folder, "model.safetensors"), "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrained, "write_folder", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pretrained.converted(str(gguf), log=lambda line: None)
    lock = f"gguf-model-{pretrained.fingerprint(str(gguf))}.lock"
    assert os.listdir(tmp_path / "cache") == [lock]


def test_the_next_conversion_removes_what_a_killed_one_left(tmp_path, monkeypatch):
    gguf, cache = tmp_path / "model.gguf", tmp_path / "cache"
    gguf.write_bytes(b"GGUF stand-in")
    killed = textwrap.dedent(f"""
        import os
        from infra import pretrained
        def killed(path, folder):                           # killed half-way: no cleanup runs
            os.makedirs(folder)
            open(os.path.join(folder, "model.safetensors"), "wb").write(b"half")
            os._exit(9)
        pretrained.write_folder = killed
        pretrained.converted({str(gguf)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", killed], cwd=ROOT, capture_output=True, text=True,
                          env={**ENV, "REPLAY_RL_CACHE": str(cache)}, timeout=60)
    assert proc.returncode == 9 and len([name for name in os.listdir(cache) if ".tmp" in name]) == 1

    def whole(path, folder):
        os.makedirs(folder)
        open(os.path.join(folder, "model.safetensors"), "wb").write(b"whole")

    monkeypatch.setenv("REPLAY_RL_CACHE", str(cache))
    monkeypatch.setattr(pretrained, "write_folder", whole)
    folder = pretrained.converted(str(gguf), log=lambda line: None)
    assert open(os.path.join(folder, "model.safetensors"), "rb").read() == b"whole"
    assert not [name for name in os.listdir(cache) if ".tmp" in name]


# ---- rewards: NumPy and torch scalars; a time limit that holds ----------------------------
def reward_file(tmp_path, body: str) -> str:
    (tmp_path / "graders.py").write_text(textwrap.dedent(body))
    return str(tmp_path / "graders.py")


def test_a_reward_of_a_numpy_or_torch_scalar_counts_and_one_that_is_no_number_is_refused(tmp_path):
    path = reward_file(tmp_path, """
        import numpy as np, torch
        def tensor(p, c): return torch.tensor(0.5)
        def int_tensor(p, c): return torch.tensor(1)
        def array(p, c): return np.array(0.25)
        def float32(p, c): return np.float32(1)
        def int64(p, c): return np.int64(0)
        def bool_(p, c): return np.bool_(True)
        def nan(p, c): return torch.tensor(float("nan"))
        def inf(p, c): return np.float64("inf")
        def text(p, c): return "1.0"
        def raw(p, c): return b"1"
        def text_array(p, c): return np.array("1.0")
        def listed(p, c): return [1.0]
        def two(p, c): return torch.tensor([1.0, 0.0])
        def one_of_one(p, c): return np.array([1.0])
        def complex_(p, c): return np.complex128(1 + 2j)
    """)
    numbers = {"tensor": 0.5, "int_tensor": 1.0, "array": 0.25, "float32": 1.0, "int64": 0.0,
               "bool_": 1.0}
    refused = {"nan": "not a finite number", "inf": "not a finite number",
               "text": "str '1.0', not a number", "raw": "bytes b'1', not a number",
               "text_array": "not a number", "listed": "list [1.0], not a number",
               "two": "Tensor of shape (2,), not one number",
               "one_of_one": "ndarray of shape (1,), not one number", "complex_": "not a number"}
    for name, value in numbers.items():
        reward = tasks.load_reward(f"{path}:{name}")
        assert reward("1+2=", "3") == value and type(reward("1+2=", "3")) is float
        for mode in ("raise", "zero"):
            checked = loading.CheckedReward(reward, mode)
            assert checked("1+2=", "3") == value and checked.errors == 0
    for name, words in refused.items():
        reward = tasks.load_reward(f"{path}:{name}")
        with pytest.raises((TypeError, ValueError)) as refusal:
            reward("1+2=", "3")
        assert str(refusal.value).startswith(f"--reward {path}:{name} returned ")
        assert words in str(refusal.value)
        with pytest.raises(loading.RewardError) as e:      # train.py saves the run, then exits
            loading.CheckedReward(reward, "raise")("1+2=", "3")
        assert str(e.value).startswith("the reward function failed on prompt '1+2=' "
                                       "with completion '3'")
        assert words in str(e.value) and "\n" not in str(e.value)
        checked = loading.CheckedReward(reward, "zero")
        assert checked("1+2=", "3") == 0.0 and checked.errors == 1


@pytest.fixture
def alarm_restored():
    """The test's SIGALRM handler and timer are put back, whatever the test did."""
    handler = signal.getsignal(signal.SIGALRM)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, handler)


def test_a_reward_that_cancels_the_alarm_still_times_out(alarm_restored):
    def cancels(prompt, completion):
        signal.alarm(0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        time.sleep(0.6)
        return 1.0

    checked = loading.CheckedReward(cancels, "zero", timeout=0.3)
    assert checked("p", "c") == 0.0 and checked.errors == 1
    with pytest.raises(loading.RewardError, match="RewardTimeout: took longer than 0.3 s"):
        loading.CheckedReward(cancels, "raise", timeout=0.3)("p", "c")


def test_a_reward_that_catches_every_exception_is_still_cut_off(alarm_restored):
    def swallows(prompt, completion):           # a grader that skips a case it cannot judge
        for case in range(20):
            try:
                time.sleep(0.1)
            except Exception:
                continue
        return 1.0

    start = time.monotonic()
    checked = loading.CheckedReward(swallows, "zero", timeout=0.3)
    assert checked("p", "c") == 0.0 and checked.errors == 1
    assert time.monotonic() - start < 1.0                   # cut at 0.3 s, not run on for 2 s


def test_the_host_programs_timer_survives_a_reward_call(alarm_restored):
    fired = []
    signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(time.monotonic()))
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 0.8)
    checked = loading.CheckedReward(lambda p, c: 1.0, "raise", timeout=0.3)
    assert checked("p", "c") == 1.0
    assert 0.6 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.8  # re-armed with the time left
    while not fired and time.monotonic() - start < 3:
        time.sleep(0.05)
    assert fired and 0.7 < fired[0] - start < 1.5
    fired.clear()                                   # a host timer that was due during the call
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    slow = loading.CheckedReward(lambda p, c: time.sleep(0.2) or 1.0, "raise", timeout=1)
    assert slow("p", "c") == 1.0
    time.sleep(0.05)
    assert fired                                            # fired right after it, not lost
