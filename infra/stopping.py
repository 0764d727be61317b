"""How a run that stops goes on. The first Ctrl-C / SIGTERM / SIGHUP (StopRequest) cuts the round
under way short and saves the run as that round began, naming the command that resumes it; every
other ending does the same (StopRequest.end: a reward's error, an exception, SystemExit or
KeyboardInterrupt raised by code). What cannot wait (a step that hangs, a reward that catches the
stop or ignores its time limit) has the round's start saved from the watchdog thread. Only the run's own process stops so and saves: a process forked from it
(a reward's child) behaves as if no handler were installed and writes nothing into the run folder.
A second signal exits at once, naming how the run goes on (how_to_go_on, disk_full_message).
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import traceback

import torch

from infra import checkpoint
from infra import distributed
from infra import runfolder
from infra.checkpoint import find, rng_states


def to_cpu(value):
    """A state_dict's tensors on the CPU (nested dicts and lists kept), for a copy of it."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def disk_full_message(e: runfolder.DiskFull) -> str:
    """One line: the limit, the file, the disk, the last checkpoint (intact) and how to go on."""
    where, fix = runfolder.limit_in_words(e.reason, e.run_dir)
    last = find(e.run_dir) if os.path.isdir(e.run_dir) else None
    resume = distributed.command(f"train.py --resume {e.run_dir}")
    then = (f"the last checkpoint, {last}, is intact: {fix}, then {resume}" if last else
            f"no checkpoint yet: {fix}, then {resume} starts the run again from its config"
            if os.path.isfile(os.path.join(e.run_dir, "config.json")) else
            f"nothing of the run was saved yet: {fix} and start it again")
    kept = (f"; the trained adapter was saved to {e.kept} (PeftModel.from_pretrained loads it) "
            "before the checkpoint failed" if e.kept else "")
    return f"{e.reason}: {e.path} could not be written ({where}){kept}; {then}"


class Interrupted(BaseException):
    """A round (or an eval) cut short by the first Ctrl-C / SIGTERM (StopRequest.round): the run is
    saved as the round began, and a resume does it again. A BaseException, so that a reward's
    ``except Exception`` cannot swallow it."""


def how_to_go_on(run_dir: str | None) -> str:
    """How a run that stopped without saving goes on, in words: from its last checkpoint, or (none
    yet) started again from its config, each by one command."""
    if not run_dir or not os.path.isdir(run_dir):
        return "nothing had been written yet: start the run again"
    command = distributed.command(f"train.py --resume {run_dir}")
    last = find(run_dir)
    if last:
        return f"the last checkpoint is {last}: resume with {command}"
    return f"no checkpoint yet: {command} starts the run again from its config"


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))     # SIGHUP: the terminal was closed
SECOND_GRACE = 5        # s: a second signal that the running code caught ends the process anyway


class Ended(SystemExit):
    """The run's end, its checkpoint saved and its last line printed: exits as it is (the loop's
    handler of every other ending lets it through)."""


def say(line: str) -> None:
    """A line on stderr (rank 0); dropped when stderr is gone (a closed terminal, a closed pipe)."""
    try:
        distributed.print0(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def ending_in_words(e: BaseException) -> str:
    """What ended a run, for its last line: a reward's error and a SystemExit's message as they
    are (the loop's own 'Last checkpoint' dropped: the saved one follows), out of GPU memory as
    the knobs that help, else the exception, its first line and where it was raised."""
    from infra.cli import OOM_HELP
    from infra.loading import RewardError

    frames = traceback.extract_tb(e.__traceback__)
    where = f" (raised at {frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})" \
        if frames else ""
    if isinstance(e, (RewardError, torch.OutOfMemoryError)):
        return str(e) if isinstance(e, RewardError) else OOM_HELP
    if isinstance(e, SystemExit) and isinstance(e.code, str):
        return re.sub(r"\s*Last checkpoint: \S+$", "", e.code.removeprefix("error: "))
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r}){where}: the code called sys.exit during the run"
    if isinstance(e, KeyboardInterrupt):
        return f"KeyboardInterrupt{where}: raised by the code, not by a signal"
    text = " ".join(str(e).split())
    return f"{type(e).__name__}{': ' + text[:300] if text else ''}{where}"


def exit_code(e: BaseException) -> int:
    """The exit code of a run that ``e`` ended: a SystemExit's own (1 for 0, None or a message:
    the run did not finish), 130 for a KeyboardInterrupt, else 1."""
    if isinstance(e, SystemExit):      # status: the code of a line that ends a run (a worker's)
        code = getattr(e, "status", e.code)
        return code if isinstance(code, int) and code else 1
    return 128 + signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1


def main(config_class, train, argv, doc: str) -> dict:
    """python train.py's frame around the loop: the flags (cli.parse), the task, then
    train(cfg, task, stop, saved); out of memory, a full disk and a damaged checkpoint as one line;
    from the first moment a first Ctrl-C keeps the run, a second exits at once."""
    from infra import cli
    from infra import loading
    from infra import report

    stop = StopRequest()                # from here on, a first Ctrl-C keeps the run
    try:
        cfg, saved = cli.parse(config_class, argv, doc)
        report.quiet_libraries()
        task = loading.load_task(cfg)
        if not cfg.max_rounds:
            cfg = dataclasses.replace(cfg, max_rounds=task.max_rounds)
        return train(cfg, task, stop, saved)
    except torch.OutOfMemoryError:
        report.close_bars()             # the ending line on a line of its own, no bar below it
        sys.exit(f"error: {cli.OOM_HELP}")
    except runfolder.DiskFull as e:
        report.close_bars()
        sys.exit(f"error: {disk_full_message(e)}")
    except checkpoint.Damaged as e:     # seen once the model loaded: token ids past its vocabulary
        report.close_bars()
        distributed.exit_all(f"error: --resume: damaged checkpoint, {e}", 2)
    except KeyboardInterrupt as e:      # a second signal
        stop.interrupted_again(e)
    finally:
        stop.restore()
        loading.end_reward_processes()  # the reward's process, and what it started
        runfolder.unlock_runs()
        report.flush_stdout()           # `train.py | head`: no BrokenPipeError at exit


class StopRequest:
    """The first Ctrl-C / SIGTERM / SIGHUP: the run is saved as it was when the round under way
    began (``round``), and a resume does that round again, exactly. Inside a round the signal
    raises Interrupted at once (a generation, a step, an eval: each is cut short; the round's
    start is the safe point, copied when it began: the loop state, the prompt stream, torch's RNG
    streams, the buffer, the trainable weights and the optimizer's state). Between rounds (a
    checkpoint being written) the loop finishes what it does and saves there. What does not return
    to Python within ``grace`` seconds (a step that hangs; a reward stuck in C code with
    --reward-timeout 0: else it runs in a process of its own) is given up
    (``give_up``): the round's start is saved from the watchdog thread and the process exits. A
    second signal exits at once, without saving. Only the process that made the StopRequest (the
    run's own) stops so: in a process forked from it (a reward's child) the handler does what the
    signal would do without it. With torchrun or generation workers nothing is cut short and no
    round start is copied: the loop saves where it stands at the end of the round (torchrun: every
    process must reach the same collectives) or at the end of its loop's turn (async: after the
    round that arrived and its steps)."""

    def __init__(self, grace: float | None = None):
        self.owner = os.getpid()        # the run's own process
        self.signum = None              # the signal this process received
        self.agreed = None              # the signal that stops the run, once any process has one
        if grace is None:               # REPLAY_RL_STOP_GRACE: the tests' shorter grace
            grace = float(os.environ.get("REPLAY_RL_STOP_GRACE", 30))
        self.grace, self.run_dir, self.watchdog, self.fallback = grace, None, None, None
        self.cutting = False            # inside ``round`` or ``abortable``: a signal raises there
        self.second = None              # the second signal, which exits at once
        self.run = None                 # watch(run): the run a give-up saves
        self.lock = threading.RLock()   # held by a save from the watchdog; the loop waits on it
        self.start = None               # the round under way as it began (``round``), or None
        self.what = None                # that round, in words
        self.ending = False             # the loop saves its end (``end``): no give-up then
        self.previous = {s: signal.signal(s, self) for s in STOP_SIGNALS}

    def __call__(self, signum, frame):
        if os.getpid() != self.owner:
            return self.unhandled(signum, frame)
        self.signum = signum
        for s in STOP_SIGNALS:          # a second one: exit at once
            signal.signal(s, self.again)
        say(f"\n{signal.Signals(signum).name}: stopping to save a checkpoint (a round under way is "
            f"cut short, saved as it began and done again on resume; what does not stop within "
            f"{self.grace:.0f} s is given up). Ctrl-C again to exit at once, without saving")
        if self.watchdog is None:
            self.watchdog = threading.Timer(self.grace, self.give_up)
            self.watchdog.daemon = True
            self.watchdog.start()
        if self.cutting:
            self.cutting = False
            raise Interrupted(signal.Signals(signum).name)

    def unhandled(self, signum, frame):
        """In a process forked from the run: what the signal does without this handler (SIGINT:
        KeyboardInterrupt; SIGTERM, SIGHUP: their default action, which ends the process)."""
        previous = self.previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            return previous(signum, frame)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if previous != signal.SIG_IGN:
            os.kill(os.getpid(), signum)

    def again(self, signum, frame):
        """The second signal: KeyboardInterrupt, wherever the run is (train.main exits, naming how
        the run goes on, with 128 + this signal); within ``signals_held`` at that block's end.
        Code that catches it (a reward's bare except) does not keep the process: it exits
        SECOND_GRACE seconds later all the same."""
        if os.getpid() != self.owner:
            return self.unhandled(signum, frame)
        self.second = signum
        if self.fallback is None:
            self.fallback = threading.Timer(SECOND_GRACE, self.exit_now)
            self.fallback.daemon = True
            self.fallback.start()
        if checkpoint.deferred(signum):     # a checkpoint's folders being swapped: at the end
            return
        raise KeyboardInterrupt

    def exit_now(self) -> None:
        from infra.loading import end_reward_processes

        say(f"\ninterrupted again: exited at once, without saving; {how_to_go_on(self.run_dir)}")
        end_reward_processes()          # os._exit runs no clean-up
        os._exit(128 + self.second)

    def watch(self, run) -> None:
        """From here on a give-up saves ``run`` (train.Run: out, cfg, state, rng, model,
        optimizer, buffer, reward_fn) as the round under way began; a reward that ignores its time
        limit has it saved the same way (``rescue``)."""
        self.run, self.run_dir = run, run.out
        run.reward_fn.stuck = self.rescue

    def copies_rounds(self) -> bool:
        """Whether a round's start is copied: one process, the synchronous loop."""
        return (self.run is not None and distributed.world_size() == 1
                and not getattr(self.run.cfg, "generators", 0))

    @contextlib.contextmanager
    def round(self, run, what: str | None = None):
        """One round of the loop (or an eval that stands alone, the first and the last: ``what``,
        in words): its start copied (``begin_round``), and within it the first signal raises
        Interrupted at once; any ending inside saves the run as the round began (``end``). One
        process only: with torchrun or workers the block runs to its end and the loop saves after
        it."""
        if not self.copies_rounds():
            yield
            return
        self.begin_round(run, what or f"round {run.state.round + 1}")
        try:
            if self.signum is not None:
                raise Interrupted(signal.Signals(self.signum).name)
            self.cutting = True
            yield
        finally:
            self.cutting = False
        with self.lock:                 # a save from the watchdog under way: wait (it exits)
            self.start = None

    def begin_round(self, run, what: str) -> None:
        """The run as it is now, the round's safe point, copied: the loop state, the prompt stream,
        torch's RNG streams, the buffer (its rollouts, their use counts, its sampler), and the
        trainable weights and the optimizer's state, on the CPU (three times the adapter's size:
        its weights and AdamW's two moments). what: the round, in words."""
        buffer = run.buffer
        weights = {name: p.detach().to("cpu", copy=True)
                   for name, p in run.model.named_parameters() if p.requires_grad}
        optimizer = copy.deepcopy(to_cpu(run.optimizer.state_dict()))
        with self.lock:
            self.start = (dataclasses.asdict(run.state), run.rng.getstate(), rng_states(),
                          list(buffer.items), [r.uses for r in buffer.items],
                          buffer.generator.get_state(), list(buffer.left_by_uses),
                          weights, optimizer)
            self.what = what

    @contextlib.contextmanager
    def abortable(self, state=None):
        """A phase the first signal cuts short outside a round (an async run's eval): within this
        block it raises Interrupted (at once if a signal came before); cut short or failed, it puts
        ``state`` (a dataclass) back as it was when the block began, field by field. One process
        only: with torchrun the block runs to its end."""
        if distributed.world_size() > 1 or self.cutting:     # inside a round: the round's start
            yield
            return
        before = dataclasses.asdict(state) if state is not None else {}
        try:
            if self.signum is not None:
                raise Interrupted(signal.Signals(self.signum).name)
            self.cutting = True
            yield
        except BaseException:
            for name, value in before.items():
                setattr(state, name, value)
            raise
        finally:
            self.cutting = False

    def give_up(self) -> None:
        """What the signal interrupted did not stop within the grace: save the run as the round
        under way began (``rescue``) and exit."""
        with self.lock:
            if self.ending:             # the loop reached its save meanwhile
                return
            self.rescue(f"{self.doing()} did not stop within {self.grace:.0f} s of "
                        f"{signal.Signals(self.signum).name}", 128 + self.signum)

    def doing(self) -> str:
        """What the run is doing, in words."""
        if self.run is None:
            return "loading (or building) the model" if self.run_dir is None else "the start"
        if not self.copies_rounds():
            return "the run (torchrun or generation workers: no round's start is copied)"
        return "the save between two rounds" if self.start is None else self.what

    def rescue(self, reason: str, code: int = 1) -> None:
        """Exit at once, with one line: ``reason``, and the checkpoint of the run as the round under
        way began, which a resume does again; or, where there is no such copy (torchrun, async,
        between rounds), how the run goes on without it. From the watchdog thread, or from a
        reward's time limit (loading.CheckedReward.stuck)."""
        from infra import loading

        with self.lock:
            what = self.doing()
            try:
                path = self.save_round_start()
            except Exception as e:      # a full disk, say
                path, reason = None, f"{reason}; its checkpoint could not be saved ({e})"
            if path:
                resume = distributed.command(f"train.py --resume {self.run_dir}")
                say(f"{reason}: saved the run as it was before {what} to {path}; resume with: "
                    f"{resume}")
            else:
                say(f"{reason}: exited without saving; {how_to_go_on(self.run_dir)}")
            loading.end_reward_processes()      # os._exit runs no clean-up
            os._exit(code)

    def save_round_start(self) -> str | None:
        """The checkpoint of the run as the round under way began (``begin_round``'s copy), written
        without touching the live run; None outside a round."""
        if self.start is None:
            return None
        state, prompts, torch_rng, items, uses, sampler, left, weights, optimizer = self.start
        run = self.run
        buffer = copy.copy(run.buffer)          # as it was: the loop's own stays as it is
        buffer.items = [dataclasses.replace(r, uses=n) for r, n in zip(items, uses)]
        buffer.generator = torch.Generator().set_state(sampler)
        buffer.left_by_uses = left
        rng = random.Random()
        rng.setstate(prompts)
        return checkpoint.save(run.out, state, dataclasses.asdict(run.cfg), model=run.model,
                               optimizer=optimizer, buffer=buffer, rng=rng, torch_rng=torch_rng,
                               weights=weights)

    def saving(self) -> None:
        """The loop reached its save: it may take the time it needs."""
        if self.watchdog is not None:
            self.watchdog.cancel()

    def requested(self) -> bool:
        """Whether a signal asked to stop, in any process: all stop at the same round, or the
        others would wait for it forever (a collective: every process asks at the same points)."""
        if self.agreed is None:
            self.agreed = int(distributed.maxima({"signal": self.signum or 0})["signal"]) or None
        return self.agreed is not None

    def keeps_run_after(self, e: BaseException) -> bool:
        """Whether the loop saves the run after ``e`` ended it (a reward's error, any exception,
        SystemExit or KeyboardInterrupt raised by code): not after a second signal, not in a
        process forked from the run, not under torchrun (the other processes are not at this
        point), not after a full disk (its own line names the intact checkpoint), not after the
        run's own end (Ended)."""
        return (os.getpid() == self.owner and distributed.world_size() == 1
                and not (isinstance(e, KeyboardInterrupt) and self.second)
                and not isinstance(e, (Ended, runfolder.DiskFull, runfolder.NotTheWriter)))

    def end(self, run, save, cause: BaseException | None = None) -> None:
        """The loop's end: inside a round, the run as the round began (``save_round_start``), else
        ``save(run)`` as it stands; then exit with what ended the run, the checkpoint and the
        command that resumes it (raises Ended): two lines and 128 + the signal, or one line and
        ``exit_code(cause)``. A save that fails too names the cause and how the run goes on (a
        full disk: its own line)."""
        with self.lock:                 # a give-up under way: wait (it exits); none after this
            self.ending = True
            self.saving()
        why = None if cause is None else ending_in_words(cause)
        try:
            path = self.save_round_start() or save(run)
        except Exception as e:
            if isinstance(e, (runfolder.DiskFull, runfolder.NotTheWriter)):
                raise
            say(f"error: {why or 'interrupted'}; the checkpoint could not be saved "
                f"({type(e).__name__}: {e}); {how_to_go_on(run.out)}")
            raise Ended(1) from None
        with contextlib.suppress(OSError, ValueError):     # its bar on a closed terminal
            run.reporter.close()
        resume = distributed.command(f"train.py --resume {run.out}")    # or torchrun
        if cause is None:
            say(f"interrupted: checkpoint saved to {path}\nresume with: {resume}")
            raise Ended(128 + (self.agreed or self.signum))     # one process: its own signal
        say(f"error: {why}; checkpoint saved to {path}; resume with: {resume}")
        raise Ended(exit_code(cause))

    @contextlib.contextmanager
    def keeping(self, run, save):
        """The loop inside it keeps the run, however it ends: the first signal (Interrupted) and
        any other ending (a reward's error, an exception, SystemExit or KeyboardInterrupt raised by
        code, a generation worker that failed) save it (``end``: inside a round, as the round
        began); a second signal, a process forked from the run, torchrun's other ranks and a full
        disk exit as they are."""
        try:
            yield
        except Interrupted:
            self.end(run, save)
        except BaseException as e:
            if not self.keeps_run_after(e):
                raise
            self.end(run, save, cause=e)

    def interrupted_again(self, e: KeyboardInterrupt) -> None:
        """Exit (code 128 + the signal) after a second signal, naming how the run goes on. A
        KeyboardInterrupt that no signal of ours raised: in a process forked from the run,
        raised on as Python does; else (code before the loop, a --reward at import) one line."""
        if os.getpid() != self.owner:
            raise e
        how = how_to_go_on(self.run_dir)
        if self.second is None:
            distributed.exit_all(f"error: {ending_in_words(e)}; {how}", 128 + signal.SIGINT)
        distributed.exit_all(f"\ninterrupted again: exited at once, without saving; {how}",
                             128 + self.second)

    def restore(self):
        self.saving()
        if self.fallback is not None:
            self.fallback.cancel()
        if os.getpid() != self.owner:
            return
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# ---- processes that end with the run (async_rl.py's workers) -------------------------------------
def dying_with_trainer(ctx):
    """Linux: the workers' interpreter started through a launcher that asks for SIGKILL when the
    trainer dies (PR_SET_PDEATHSIG, kept across exec) before Python imports anything, so a worker
    still importing torch dies with the trainer too (worker_main asks again, for other systems'
    sake checks its parent while it waits). Returns the launcher's folder ("" where there is none)
    and what undoes it once the workers are gone (spawn's interpreter is a setting of the whole
    process)."""
    import multiprocessing.spawn

    if sys.platform.startswith("linux"):
        remove_launchers_left()
    folder = (tempfile.mkdtemp(prefix=f"replay-rl-{os.getpid()}-")
              if sys.platform.startswith("linux") else "")
    if not folder or os.statvfs(folder).f_flag & os.ST_NOEXEC:   # worker_main asks itself
        if folder:
            os.rmdir(folder)
        return "", lambda: None
    path, executable = os.path.join(folder, "worker-python"), multiprocessing.spawn.get_executable()
    with open(path, "w") as f:
        f.write(f"#!{sys.executable} -S\n" + LAUNCHER)
    os.chmod(path, 0o700)
    os.environ["REPLAY_RL_TRAINER_PID"] = str(os.getpid())
    ctx.set_executable(path)

    def undo():
        multiprocessing.spawn.set_executable(os.fsdecode(executable))
        shutil.rmtree(folder, ignore_errors=True)
    return folder, undo


SEMAPHORES = "semaphores"       # in the launcher folder: the names of the workers' semaphores


def note_semaphores(folder: str, *objects) -> list[str]:
    """Writes into the launcher folder the names of the named semaphores (/dev/shm/sem.mp-*)
    behind ``objects``: the queues, locks and shared values the trainer made for its workers.
    multiprocessing's resource tracker unlinks them when the trainer ends, even by SIGKILL; but a
    SIGKILL to the whole process group (systemd, Slurm, docker kill) kills the tracker too. The
    next trainer that starts workers then unlinks them (remove_launchers_left). Returns the
    names; writes nothing without a folder (not Linux, or a temporary directory mounted noexec)."""
    from multiprocessing.synchronize import SemLock
    names, seen = [], set()

    def walk(obj, depth: int) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        if isinstance(obj, SemLock):
            if getattr(obj._semlock, "name", None):
                names.append(obj._semlock.name)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for item in vars(obj).values():
                walk(item, depth + 1)
    for obj in objects:
        walk(obj, 0)
    if folder:
        with open(os.path.join(folder, SEMAPHORES), "w") as f:
            f.write("".join(name + "\n" for name in names))
    return names


def unlink_semaphores(folder: str) -> int:
    """Unlinks the named semaphores a dead trainer's launcher folder lists (note_semaphores);
    returns how many were still there."""
    import _multiprocessing
    try:
        with open(os.path.join(folder, SEMAPHORES)) as f:
            names = f.read().split()
    except OSError:
        return 0
    removed = 0
    for name in names:
        try:
            _multiprocessing.sem_unlink(name)
            removed += 1
        except OSError:             # unlinked already: the resource tracker outlived the trainer
            pass
    return removed


def remove_launchers_left() -> list[str]:
    """The launcher folders (replay-rl-<pid>-*) of trainers no longer alive, removed: a trainer
    killed with SIGKILL, or one that failed while its workers started, could not remove its own.
    Says how many, if any. Returns their paths."""
    import glob
    left, semaphores = [], 0
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "replay-rl-*-*")):
        pid = os.path.basename(folder).split("-")[2]
        if not pid.isdigit() or alive(int(pid)) or not os.path.isdir(folder):
            continue
        semaphores += unlink_semaphores(folder)
        shutil.rmtree(folder, ignore_errors=True)
        left.append(folder)
    if left:
        also = (f" and {semaphores} semaphore(s) in /dev/shm their resource tracker, killed with "
                "them, had left" if semaphores else "")
        say(f"removed {len(left)} launcher folder(s){also} of trainers that ended without "
            f"removing them (killed): {', '.join(left)}")
    return left


def alive(pid: int) -> bool:
    """Whether a process of this id exists (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


LAUNCHER = """import ctypes, os, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)    # PR_SET_PDEATHSIG, SIGKILL
except OSError:
    pass
if os.getppid() != int(os.environ["REPLAY_RL_TRAINER_PID"]):  # the trainer died before it
    os._exit(1)
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def quiet_resource_tracker() -> None:
    """multiprocessing's resource tracker started with no stderr: when the trainer is killed
    (kill -9) it frees the queues' semaphores, and its 'leaked semaphore' warning would reach the
    terminal after the run has ended."""
    from multiprocessing import resource_tracker
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def stopped(pid: int) -> bool:
    """Whether a process is stopped (SIGSTOP, a debugger): Linux's /proc; elsewhere, not known."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended on this machine since it booted, a
    cgroup's memory limit included (Linux's /proc/vmstat); None where that is not known."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def cpu_ticks(pid: int) -> int | None:
    """The CPU time a process has used, in clock ticks (Linux's /proc); elsewhere None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])        # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the trainer dies, however it dies (kill -9 too), so
    no worker outlives its run. Elsewhere the worker checks its parent while it waits."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)       # PR_SET_PDEATHSIG
        except OSError:
            pass
