"""The generation worker processes of async_rl.py, both sides: ``Generators`` on the trainer's
(orders out, rounds in, the adapter's weights published in shared memory, signs of life, shutdown)
and ``WorkerLink`` on a worker's (the next order, the newest weights, a round pushed back). A
worker runs async_rl.worker_loop, passed in by the trainer. A worker never writes into the run
folder and never saves: it ignores Ctrl-C (the trainer stops it), dies with the trainer (Linux),
and reports a failure to the trainer as one line, which stops the run after a checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import queue
import signal
import threading
import time
import types

import torch

from buffer import Rollout
from infra import distributed, loading, report, stopping


# ---- the trainer's side ----------------------------------------------------------------------
class WorkerFailed(SystemExit):
    """A generation worker that raised, exited, was killed or gave no sign of life: the run ends
    with this one line, after the trainer saved its checkpoint (stopping.StopRequest.keeping:
    every ending saves), with exit code ``status`` (a reward's own sys.exit code, else 1)."""

    def __init__(self, line: str, status: int = 1):
        super().__init__(line)
        self.status = status


class Generators:
    """The worker processes, from the trainer's side: orders out, rounds in, weights published.

    Orders carry the prompts (drawn from the run's prompt stream, here, so a checkpoint keeps it),
    only while the buffer has room for their rollouts unused, and at most rounds_ahead of them on
    their way. A round on its way when the run stops is dropped: its tokens were never counted, and
    a resume orders it again."""

    def __init__(self, run, worker_loop):
        self.run, self.cfg, self.n_workers = run, run.cfg, run.cfg.generators
        self.worker_loop = worker_loop          # what each worker runs: async_rl.worker_loop
        self.outstanding = 0                    # rounds ordered, not yet arrived
        self.seen = [[0.0] * 4 for _ in range(self.n_workers)]     # each worker's times so far
        self.ready = set()                      # the workers that have loaded their model
        self.clock = None                       # when the last of them was ready
        self.delivered = False                  # a round has arrived (in this process)
        self.resumed_at = time.monotonic()      # the end of the last pause (evals): no beats then
        self.procs = []
        self.orders = self.results = None       # made by __enter__
        self.undo_launcher = lambda: None

    def __enter__(self):
        """The workers started. Cut short (a Ctrl-C while they start, an error), what started of
        them is stopped and the launcher folder removed before the exception goes on."""
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def start(self):
        ctx = multiprocessing.get_context("spawn")      # a fresh interpreter: no handler, no lock
        self.weights = shared_weights(trainable(self.run.model))
        stopping.quiet_resource_tracker()       # before the launcher: it outlives a killed trainer
        launcher, self.undo_launcher = stopping.dying_with_trainer(ctx)
        self.version = ctx.Value("q", -1)               # the published weights' policy_version
        self.trainer_step = ctx.Value("q", 0)
        self.lock = ctx.Lock()
        self.orders, self.results = Orders(ctx, self.n_workers, self.procs), ctx.Queue()
        self.beats = ctx.Array("d", [0.0] * self.n_workers)     # each one's last beat (0: none yet)
        self.starting = [(None, time.monotonic())] * self.n_workers     # (CPU ticks, seen when)
        self.oom_kills = stopping.oom_kills()           # the OOM killer's count so far
        self.paused_seconds = ctx.Value("d", 0.0)       # evals so far: off the workers' clocks
        stopping.note_semaphores(launcher, self.version, self.trainer_step, self.lock,
                                 self.orders, self.results, self.beats, self.paused_seconds)
        devices = worker_devices(self.cfg)
        threads = threads_each(self.n_workers, devices[0])
        if not devices[0].startswith("cuda"):
            torch.set_num_threads(threads)              # the trainer's share of the cores
        # no run folder: a worker writes nothing there, and knows not where it is
        config = {**dataclasses.asdict(self.cfg), "progress": False, "resume": "", "output_dir": ""}
        # Ctrl-C held back, not ignored: the trainer's arrives once they are started, and the
        # workers, which inherit the mask, never see one (worker_main ignores it, then unblocks)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for i in range(self.n_workers):
                p = ctx.Process(target=worker_main, name=f"generation worker {i}", daemon=True,
                                args=(i, self.worker_loop, config, devices[i], threads,
                                      os.getpid(), self.orders.queues[i], self.results,
                                      self.weights, self.version, self.trainer_step, self.lock,
                                      self.beats, self.paused_seconds))
                p.start()
                self.procs.append(p)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        self.run.pause_workers = self.paused
        return self

    def __exit__(self, *exc):
        self.run.pause_workers = contextlib.nullcontext
        self.account(self.run.state)
        self.stop()
        return False

    @contextlib.contextmanager
    def paused(self):
        """No worker generates while the trainer evaluates (off the wall clock): each that has
        loaded its model (one still loading has no order to work on) is stopped (SIGSTOP) and
        continued after, and the seconds it was stopped come off its own times, so no generation
        goes unclocked."""
        start = time.perf_counter()
        loading = [p for i, p in enumerate(self.procs) if i not in self.ready]
        stalled = [p for p in self.procs if stopping.stopped(p.pid)]     # by someone else: left so
        self.signal_all(signal.SIGSTOP, but=loading)
        try:
            yield
        finally:                                # counted before they go on, which read it
            with self.paused_seconds.get_lock():
                self.paused_seconds.value += time.perf_counter() - start
            self.signal_all(signal.SIGCONT, but=loading + stalled)
            self.resumed_at = time.monotonic()

    def signal_all(self, signum, but=()) -> None:
        for p in self.procs:
            if p not in but:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    def publish(self, model, step: int) -> None:
        """The adapter's weights (LoRA only), for the workers to load before their next round.
        A worker killed while it copies them holds their lock for ever: the trainer waits for it
        checking that every worker lives, so such a death ends the run in one line, not a hang."""
        while not self.lock.acquire(timeout=0.5):
            self.check_alive()
        try:
            offset = 0
            for p in trainable(model):
                self.weights[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()
            self.version.value = step
        finally:
            self.lock.release()
        self.trainer_step.value = step

    def order(self, prompts: list[str]) -> None:
        """A round for the next free worker: P prompts."""
        self.orders.put(prompts)
        self.outstanding += 1

    def trainer_at(self, step: int) -> None:
        """The trainer's step, which a worker past --max-lag waits on."""
        self.trainer_step.value = step

    @property
    def published(self) -> int:
        """The policy_version of the weights published last (-1: none yet)."""
        return self.version.value

    def take_round(self, wait: bool):
        """The next round a worker pushed, as (rollouts, figures), or None: none has arrived (with
        ``wait``: none arrived before a stop). While it waits, it checks that every worker lives."""
        state, start = self.run.state, time.perf_counter()
        self.check_alive()
        while True:
            try:
                message = self.results.get(timeout=0.05) if wait else self.results.get_nowait()
            except queue.Empty:
                if not wait or self.run.stop.requested():
                    message = None
                    break
                self.check_alive()
                self.orders.reroute()
                continue
            if message[0] == "round" and not self.orders.arrived(message[5]):
                continue                # ordered again from another worker, which delivered it
            if message[0] != "ready":
                break
            self.ready.add(message[1])  # a worker loaded its model: the clock starts with the last
            if len(self.ready) == self.n_workers:
                self.run.reporter.restart_clock(state)
                self.clock = time.perf_counter()
        if wait and self.clock is not None:
            state.trainer_wait_seconds += time.perf_counter() - max(start, self.clock)
        if message is None:
            return None
        if message[0] == "failed":
            raise WorkerFailed(f"generation worker {message[1]} failed: {message[2]}", message[3])
        _, i, packed, gen, times, _ = message
        self.delivered = True
        # a worker's times since it started: waiting for weights, for room; generating (wall,
        # CPU); the loop state keeps their sums over the workers
        new = [now - before for now, before in zip(times, self.seen[i])]
        self.seen[i] = times
        state.worker_weights_wait_seconds += new[0]
        state.worker_room_wait_seconds += new[1]
        state.gen_seconds += new[2]
        state.gen_cpu_seconds += new[3]
        self.outstanding -= 1
        return unpack(packed), gen

    def check_alive(self) -> None:
        """WorkerFailed if a worker has ended (with the line it sent, else how it ended) or has
        given no sign of life for --worker-timeout seconds (stopped, or hung with the GIL held)."""
        now, limit = time.monotonic(), self.cfg.worker_timeout
        for i, p in enumerate(self.procs):
            beat = self.beats[i] or self.started_at(i, p.pid, now)
            silent = now - max(beat, self.resumed_at)
            if p.exitcode is None and limit and silent > limit:
                when = "" if self.beats[i] else " while starting (no CPU time used)"
                raise WorkerFailed(f"generation worker {i} (pid {p.pid}) gave no sign of life for "
                                   f"{silent:.0f} s (--worker-timeout {limit:g}){when}: stopped "
                                   "(SIGSTOP, a debugger) or hung")
            if p.exitcode is None:
                continue
            try:                                # a worker that failed sent why, then exited
                while (message := self.results.get(timeout=1.0))[0] != "failed":
                    pass
                raise WorkerFailed(f"generation worker {message[1]} failed: {message[2]}",
                                   message[3])
            except queue.Empty:
                how = (f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                       else f"exited with code {p.exitcode}")
                if p.exitcode == -signal.SIGKILL:
                    how += self.out_of_memory()
                raise WorkerFailed(f"generation worker {i} (pid {p.pid}) {how}") from None

    def out_of_memory(self) -> str:
        """For a worker killed by SIGKILL: whether the kernel's OOM killer ended a process since
        the workers started (the kernel's log, where it says whom, is not readable by most), in
        words ('' if it did not, or that is not known)."""
        now = stopping.oom_kills()
        if now is None or self.oom_kills is None or now == self.oom_kills:
            return ""
        ended = now - self.oom_kills
        return (f": out of memory, most likely (the kernel's OOM killer ended {ended} process(es) "
                "since the workers started, /proc/vmstat); each worker holds a copy of the model: "
                "fewer --generators, or a smaller model")

    def started_at(self, i: int, pid: int, now: float) -> float:
        """A worker starting (no beat yet: its interpreter imports, before the heartbeat thread
        runs): when its CPU time last grew, the sign of life that a busy start-up gives (no /proc:
        when it was started)."""
        ticks, when = self.starting[i]
        used = stopping.cpu_ticks(pid)
        if used is not None and used != ticks:
            self.starting[i] = (used, now)
            return now
        return when

    def account(self, state) -> None:
        """The wall clock brought up to now (report.Report.tick: from the moment every worker had
        loaded its model, evals excluded), and the async figures of the next metrics row into its
        round_stats: the shares of wall time the trainer waited for
        rollouts and the workers (on average) for weights or for room; rollouts generated, stored
        and trained on per wall second."""
        self.run.reporter.tick(state)     # the wall clock: since every worker is ready
        wall, n = max(state.wall_seconds, 1e-9), self.n_workers
        state.round_stats.update({
            "trainer_wait_seconds": state.trainer_wait_seconds,
            "worker_weights_wait_seconds": state.worker_weights_wait_seconds,
            "worker_room_wait_seconds": state.worker_room_wait_seconds,
            "trainer_wait_frac": state.trainer_wait_seconds / wall,
            "worker_weights_wait_frac": state.worker_weights_wait_seconds / n / wall,
            "worker_room_wait_frac": state.worker_room_wait_seconds / n / wall,
            "generated_per_s": state.rollouts_generated / wall,
            "stored_per_s": state.rollouts_stored / wall,
            "trained_per_s": state.rollouts_trained / wall})

    def stop(self) -> None:
        """Every worker stopped and reaped (stop_gently); the launcher folder removed, whatever
        happens meanwhile. A second Ctrl-C while they stop waits no longer: each worker's process
        group is killed at once, and the KeyboardInterrupt goes on."""
        try:
            self.stop_gently()
        except BaseException:
            for p in self.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            raise
        finally:
            self.undo_launcher()

    def stop_gently(self) -> None:
        """Every worker stopped and reaped: asked first, then SIGTERM, then SIGKILL; then what
        they started (a reward's forked child: each worker leads a process group of its own)."""
        self.signal_all(signal.SIGCONT)         # a stopped worker cannot act on what follows
        queues = [*self.orders.queues, self.results] if self.results is not None else []
        for q in queues[:-1]:
            try:
                q.put_nowait(None)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for q in queues:
            q.cancel_join_thread()
            q.close()


class Orders:
    """The orders on their way, each with its number, one queue per worker: a worker stopped while
    it waits for one (SIGSTOP, a debugger) holds its own queue's lock, not one the others wait on.
    An order goes to the worker with the fewest on their way, a stopped one last; the orders of a
    worker found stopped go to the others (``reroute``), and its round, should it come after all,
    is dropped (its tokens never counted)."""

    def __init__(self, ctx, n_workers: int, procs: list):
        self.procs = procs                      # the workers (filled as they start)
        self.queues = [ctx.Queue() for _ in range(n_workers)]
        self.pending = {}                       # number -> (worker, prompts): its round not in
        self.count = 0                          # orders numbered so far

    def put(self, prompts: list[str]) -> None:
        self.count += 1
        self.send(self.pick(), self.count, prompts)

    def send(self, i: int, number: int, prompts: list[str]) -> None:
        self.queues[i].put((number, prompts))
        self.pending[number] = (i, prompts)

    def pick(self, but: int | None = None) -> int:
        load = [0] * len(self.queues)
        for i, _ in self.pending.values():
            load[i] += 1
        return min((i for i in range(len(self.queues)) if i != but),
                   key=lambda i: (self.stopped(i), load[i], i))

    def stopped(self, i: int) -> bool:
        return i < len(self.procs) and stopping.stopped(self.procs[i].pid)

    def reroute(self) -> None:
        """The orders of a worker found stopped, sent again to one that is not (none: they wait)."""
        for number, (i, prompts) in list(self.pending.items()):
            if len(self.queues) > 1 and self.stopped(i):
                j = self.pick(but=i)
                if not self.stopped(j):
                    self.send(j, number, prompts)

    def arrived(self, number: int) -> bool:
        """Whether the round of this order is still awaited (not delivered by another worker)."""
        return self.pending.pop(number, None) is not None


def shared_weights(params: list[torch.Tensor]) -> torch.Tensor:
    """A flat tensor in shared memory for the adapter's weights, which the workers read. Shared
    memory is a file (/dev/shm): a file-size limit below it (ulimit -f) is named as the cause."""
    size = sum(p.numel() for p in params)
    try:
        return torch.zeros(size).share_memory_()
    except RuntimeError as e:
        raise SystemExit(f"error: sharing the adapter's weights with the workers ({4 * size:,} "
                         f"bytes in shared memory, a file) failed: {e}; a file-size limit "
                         f"(ulimit -f) below that stops it: raise the limit, or run without "
                         "--generators") from None


def trainable(model) -> list[torch.Tensor]:
    """The LoRA weights, in one order in every process (the same model built the same way)."""
    return [p for p in model.parameters() if p.requires_grad]


def worker_devices(cfg) -> list[str]:
    """Each worker's device: --generator-devices, else the trainer's (one GPU is shared)."""
    if cfg.generator_devices:
        devices = [d.strip() for d in cfg.generator_devices.split(",")]
        return [devices[i % len(devices)] for i in range(cfg.generators)]
    return [distributed.pick_device(cfg.device)] * cfg.generators


def threads_each(n_workers: int, device: str) -> int:
    """CPU threads for each of the n_workers + 1 processes: the cores shared out (at least one);
    two torch processes with all the cores each slow each other many times over."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // (n_workers + 1))


# ---- packing a round to send: plain lists and numbers (no shared-memory tensors to outlive) ----
def pack(rollouts: list[Rollout]) -> list[dict]:
    return [{**{f.name: getattr(r, f.name) for f in dataclasses.fields(Rollout)},
             "prompt_ids": r.prompt_ids.tolist(), "completion_ids": r.completion_ids.tolist(),
             "behaviour_logp": r.behaviour_logp.tolist()} for r in rollouts]


def unpack(packed: list[dict]) -> list[Rollout]:
    return [Rollout(**{**d, "prompt_ids": torch.tensor(d["prompt_ids"], dtype=torch.long),
                       "completion_ids": torch.tensor(d["completion_ids"], dtype=torch.long),
                       "behaviour_logp": torch.tensor(d["behaviour_logp"], dtype=torch.float32)})
            for d in packed]


# ---- a worker's side ----------------------------------------------------------------------------
class WorkerLink:
    """A worker's ends of the queues and of the shared weights, and its waiting times."""

    def __init__(self, index, orders, results, weights, version, trainer_step, lock, parent,
                 cfg, fast=None, paused=None):
        self.index, self.orders, self.results = index, orders, results
        self.weights, self.version, self.trainer_step, self.lock = (weights, version, trainer_step,
                                                                    lock)
        self.parent, self.cfg, self.fast = parent, cfg, fast
        self.paused = paused                    # seconds the trainer has held the workers stopped
        self.loaded = -1                        # the policy_version of the weights in the model
        self.times = [0.0] * 4      # seconds waiting for weights, for room; generating: wall, CPU
        self.reward_errors = 0
        self.number = 0                         # the order under way (Orders)
        self.started = self.started_cpu = 0.0

    def clock(self) -> float:
        """A clock that stands still while the trainer holds the workers stopped (its evals)."""
        return time.perf_counter() - (self.paused.value if self.paused is not None else 0.0)

    def next_order(self):
        """The next order's prompts (waiting for one: the buffer has no room), or None: stop."""
        start = self.clock()
        while True:
            try:
                order = self.orders.get(timeout=0.5)
                break
            except queue.Empty:
                self.check_parent()
        self.times[1] += self.clock() - start
        if order is None:
            return None
        self.number, prompts = order            # the order's number, sent back with its round
        return prompts

    def load_weights(self, model) -> int:
        """The newest published weights into the model; their version. More than --max-lag steps
        behind the trainer, it waits for newer ones first."""
        start = self.clock()
        lag = self.cfg.max_lag
        while (self.version.value < 0
               or (lag and self.trainer_step.value - self.version.value > lag)):
            time.sleep(0.01)
            self.check_parent()
        if self.version.value != self.loaded:
            with self.lock:
                offset = 0
                for p in trainable(model):
                    p.data.copy_(self.weights[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
                self.loaded = self.version.value
        self.times[0] += self.clock() - start
        self.started, self.started_cpu = self.clock(), time.process_time()
        return self.loaded

    def push(self, rollouts: list[Rollout], gen: dict) -> None:
        self.times[2] += self.clock() - self.started
        self.times[3] += time.process_time() - self.started_cpu
        errors, self.reward_errors = self.reward_errors, 0
        figures = {k: v for k, v in gen.items() if k != "completions"}
        self.results.put(("round", self.index, pack(rollouts), {**figures, "reward_errors": errors},
                          list(self.times), self.number))

    def check_parent(self) -> None:
        if os.getppid() != self.parent:         # the trainer is gone (where PDEATHSIG is not)
            os._exit(1)


def worker_main(index, worker_loop, config, device, threads, parent, orders, results, weights,
                version, trainer_step, lock, beats, paused) -> None:
    """A worker process: quiet, its own threads, its own policy; then worker_loop (async_rl's).
    Any failure is sent to the trainer as one line (the worker writes nothing else anywhere)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # the trainer stops the run, and it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})     # held back while starting
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stopping.die_with_parent()
    os.setpgid(0, 0)            # a group of its own: the trainer ends what a reward forks, too
    threading.Thread(target=heartbeat, args=(beats, index), daemon=True).start()
    torch.set_num_threads(threads)
    try:
        report.quiet_libraries()
        cfg = types.SimpleNamespace(**config)
        task = loading.load_task(cfg)
        # seeded as the synchronous loop's process (LoRA init, then sampling): worker 0 in
        # --lockstep samples what train.py without workers samples; the others, streams of their own
        model, tokenizer, task = loading.load_model(cfg, task, device, rank=0)
        if index:
            torch.manual_seed(cfg.seed + 1000 * index)
        cfg.max_new_tokens = cfg.max_new_tokens or task.max_new_tokens
        fast = loading.fast_decoding(cfg, model, tokenizer, task, device) if cfg.fast_generation \
            else None
        link = WorkerLink(index, orders, results, weights, version, trainer_step, lock, parent,
                          cfg, fast, paused)
        results.put(("ready", index))
        # the reward's own process stays in this worker's group, which the trainer ends whole
        reward = loading.CheckedReward(task.reward, cfg.on_reward_error, cfg.reward_timeout,
                                       own_group=False)
        counted = CountingReward(reward, link)
        worker_loop(model, tokenizer, counted, cfg, link)
    except BaseException as e:                  # SystemExit too: a one-line exit of loading.py
        said = getattr(e, "code", None) if isinstance(e, SystemExit) else (
            str(e) if isinstance(e, (loading.RewardError, RewardExit)) else None)   # one line
        words = (str(said) if said is not None else f"{type(e).__name__}: {e}").strip().splitlines()
        line = words[0] if words else type(e).__name__
        try:
            results.put(("failed", index, line.removeprefix("error: "),
                         e.status if isinstance(e, RewardExit) else 1))
            results.close()
            results.join_thread()
        finally:
            loading.end_reward_processes()      # os._exit runs no clean-up
            os._exit(1)
    loading.end_reward_processes()
    os._exit(0)


class RewardExit(Exception):
    """A reward that called sys.exit in a worker: the line names it and the prompt, and the run
    exits with its code, as the synchronous loop would."""

    def __init__(self, prompt: str, code):
        super().__init__(f"the reward function called sys.exit({code!r}) on prompt {prompt!r}")
        self.status = code if isinstance(code, int) and code else 1


class CountingReward:
    """The checked reward, its errors (scored 0 with --on-reward-error zero) counted per round."""

    def __init__(self, reward, link: WorkerLink):
        self.reward, self.link = reward, link

    def __call__(self, prompt: str, completion: str) -> float:
        before = self.reward.errors
        try:
            value = self.reward(prompt, completion)
        except SystemExit as e:
            raise RewardExit(prompt, e.code) from None
        self.link.reward_errors += self.reward.errors - before
        return value


def heartbeat(beats, index: int) -> None:
    """A worker's sign of life, every half second, from a thread of its own: it stops only when
    the whole process does (SIGSTOP, a debugger) or its main thread holds the GIL throughout."""
    while True:
        beats[index] = time.monotonic()
        time.sleep(0.5)
