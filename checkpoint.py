"""Checkpoints: everything needed to continue a run exactly, written atomically, read back once.

    checkpoint-<round>/
        adapter/             the LoRA weights (PEFT's save_pretrained)
        optimizer.pt         AdamW's state: tensors and numbers only (read with weights_only=True)
        buffer.safetensors   the replay buffer        (with W processes, rank r > 0 adds
        rng.safetensors      torch's RNG streams       buffer-rank<r> and rng-rank<r>)
        state.json           the loop state, the prompt stream (Python's random), the config

Only tensors and JSON are read: no pickles. Also here: the first Ctrl-C / SIGTERM (StopRequest),
which lets the loop finish its step and save before it exits; and the run folder as one run's:
a new run never goes into a folder that holds another run's files (``holds_run``), default names
are unique (``new_run_dir``), and the process that writes a run folder holds its lock (``lock_run``).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

import distributed


@dataclass
class Checkpoint:
    """A checkpoint as read back: each of its files read once, what this rank needs to continue."""
    path: str
    state: dict                         # the loop state (train.LoopState's fields)
    python_rng: list                    # the prompt stream: random.Random.getstate() as JSON
    config: dict                        # the run's Config
    adapter: dict[str, torch.Tensor]    # the LoRA weights
    optimizer: dict                     # the optimizer's state_dict
    buffer: dict[str, torch.Tensor] | None  # this rank's buffer shard (ReplayBuffer.state_dict);
    rng: dict[str, torch.Tensor] | None     # its torch RNG state. None: saved by fewer processes


class Damaged(Exception):
    """A checkpoint file that does not read back, as 'file (reason)'."""


def rounds(run_dir: str) -> list[int]:
    """Rounds of a run folder's checkpoint-<round> folders, in order (not the temporary ones)."""
    return sorted(int(m.group(1)) for d in os.listdir(run_dir)
                  if (m := re.fullmatch(r"checkpoint-(\d+)", d)))


def newest_first(path: str) -> list[str]:
    """[path] if it is a checkpoint, else its complete checkpoint-<round> folders, newest first."""
    if os.path.isfile(os.path.join(path, "state.json")):
        return [path.rstrip("/")]
    if not os.path.isdir(path):
        return []
    return [os.path.join(path, f"checkpoint-{r}") for r in reversed(rounds(path))
            if os.path.isfile(os.path.join(path, f"checkpoint-{r}", "state.json"))]


def find(path: str) -> str | None:
    """path itself if it is a checkpoint, else the newest complete checkpoint-<round> inside it."""
    found = newest_first(path)
    return found[0] if found else None


def shard_name(kind: str, rank: int) -> str:
    return f"{kind}.safetensors" if rank == 0 else f"{kind}-rank{rank}.safetensors"


def read(path: str) -> Checkpoint:
    """Every file of a checkpoint, read once: this rank's loaded, the other ranks' shards checked
    (their header and size), so that every rank judges a checkpoint alike. Raises Damaged."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    def reading(name, load):
        try:
            return load(os.path.join(path, name))
        except Exception as e:      # truncated, missing, not a tensor file: "cannot resume from it"
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise Damaged(f"{name} ({type(e).__name__}: {reason})") from e

    def read_json(file):
        with open(file) as f:
            return json.load(f)

    def read_header(file):
        with safe_open(file, "pt") as f:       # fails on a truncated file, as loading would
            return list(f.keys())

    saved = reading("state.json", read_json)
    if not isinstance(saved, dict) or not {"state", "python_rng", "config"} <= saved.keys():
        raise Damaged("state.json (not a saved loop state)")
    adapter = reading("adapter/adapter_model.safetensors", load_file)
    rank = distributed.rank()
    shards = {}
    for r in range(saved["state"].get("world_size", 1)):
        for kind in ("buffer", "rng"):
            if r == rank:
                shards[kind] = reading(shard_name(kind, r), load_file)
            else:
                reading(shard_name(kind, r), read_header)
    optimizer = reading("optimizer.pt",
                        lambda p: torch.load(p, map_location="cpu", weights_only=True))
    return Checkpoint(path.rstrip("/"), upgraded(saved["state"], saved["config"]),
                      saved["python_rng"], saved["config"], adapter, optimizer,
                      shards.get("buffer"), shards.get("rng"))


def upgraded(state: dict, config: dict) -> dict:
    """A loop state as state.json holds it, with the fields that older checkpoints lack: the
    batch size of the round, the rollouts trained so far (B per step), zero lapsed updates and
    eval reward errors, one process."""
    B = config["batch_size"]
    return {"round_batch_size": B, "rollouts_trained": state["step"] * B, "lapsed_updates": 0,
            "eval_reward_errors": 0, "world_size": 1, **state}


def newest_readable(run_dir: str) -> Checkpoint | None:
    """The newest checkpoint of a run folder whose files all read back; says which were skipped."""
    for path in newest_first(run_dir):
        try:
            return read(path)
        except Damaged as e:
            distributed.print0(f"skipping {path}: damaged, {e}", file=sys.stderr)
    return None


class DiskFull(Exception):
    """A write that failed for want of space (ENOSPC, EDQUOT): ``path`` the file, ``run_dir`` its
    run folder. train.py turns it into one line (``disk_full_message``)."""

    def __init__(self, run_dir: str, path: str):
        super().__init__(path)
        self.run_dir, self.path = run_dir, path


def no_space(e: BaseException | None) -> bool:
    """Whether an exception, or one in its chain, is a full disk or quota: torch.save reports one as
    a RuntimeError ('unexpected pos ...') raised while handling the OSError, safetensors in words."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def disk_full_message(e: DiskFull) -> str:
    """One line: the file, the folder, the last checkpoint (intact) and how to go on."""
    last = find(e.run_dir) if os.path.isdir(e.run_dir) else None
    then = (f"the last checkpoint, {last}, is intact: free space, then "
            f"{distributed.command(f'train.py --resume {e.run_dir}')}" if last else
            "no checkpoint had been saved: free space and start the run again")
    return f"the disk is full: {e.path} could not be written (no space left where {e.run_dir} is); {then}"


@contextlib.contextmanager
def full_disk_as_one_line(run_dir: str, path, cleanup: str | None = None):
    """Within this block a full disk raises DiskFull(run_dir, path) (path: a string, or a function
    that gives the file being written when it failed), after removing ``cleanup`` (a half-written
    folder); other errors pass unchanged."""
    try:
        yield
    except Exception as e:
        if not no_space(e):
            raise
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise DiskFull(run_dir, path() if callable(path) else path) from None


def write_json(path: str, obj, indent: int | None = None) -> None:
    """obj as JSON at path, whole or not at all: written to path.tmp, then renamed over path; a failed
    write (a full disk, say) removes the .tmp and raises, leaving the previous file as it was."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save(run_dir: str, state: dict, config: dict, *, model, optimizer, buffer, rng) -> str:
    """Write everything needed to continue exactly, atomically: into a hidden temporary folder
    first, state.json last, then one rename. A crash mid-write leaves the older checkpoints intact;
    a full disk removes the half-written one and raises DiskFull naming the file it was writing.
    Every rank calls it (each writes its buffer shard and RNG state). state: the loop state (its
    round names the folder); config: the run's (keep_checkpoints: how many stay); rng: the prompt
    stream."""
    from safetensors.torch import save_file

    round = state["round"]
    final = os.path.join(run_dir, f"checkpoint-{round}")
    tmp = os.path.join(run_dir, f".tmp-checkpoint-{round}")
    current = tmp                       # the file being written

    def to(name: str) -> str:
        nonlocal current
        current = os.path.join(tmp, name)
        return current

    with full_disk_as_one_line(run_dir, lambda: current, cleanup=tmp):
        if distributed.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        distributed.barrier()
        save_file(buffer.state_dict(), to(shard_name("buffer", distributed.rank())))
        save_file(rng_states(), to(shard_name("rng", distributed.rank())))
        distributed.barrier()
        if distributed.is_main():        # the weights and the optimizer state: the same on every rank
            model.save_pretrained(to("adapter"))
            torch.save(optimizer.state_dict(), to("optimizer.pt"))
            with open(to("state.json"), "w") as f:
                json.dump({"state": state, "python_rng": rng.getstate(), "config": config}, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for r in rounds(run_dir)[:-config["keep_checkpoints"]]:
                shutil.rmtree(os.path.join(run_dir, f"checkpoint-{r}"), ignore_errors=True)
    distributed.barrier()
    return final


def rng_states() -> dict[str, torch.Tensor]:
    """This process's torch RNG streams: the CPU's, and the GPU's (CUDA's, each device; or a Mac's
    MPS), which sampling on that GPU draws from."""
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    if torch.backends.mps.is_available():
        states["mps"] = torch.mps.get_rng_state()
    return states


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    """Put back the streams rng_states() saved (those of a device this machine has)."""
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(states["cuda"]))
    if "mps" in states and torch.backends.mps.is_available():
        torch.mps.set_rng_state(states["mps"])


def restore(saved: Checkpoint, *, model, optimizer, buffer, rng) -> None:
    """Put a checkpoint's weights, optimizer state, buffer shard and RNG streams in place. The
    optimizer keeps its learning rate (the one given now: --lr may change on resume). Exits if the
    ranks hold checkpoints of different rounds."""
    from peft import set_peft_model_state_dict

    at = {"round": saved.state["round"]}
    low, high = distributed.minima(at)["round"], distributed.maxima(at)["round"]
    if low != high:
        distributed.exit_all(f"error: the processes resumed from different checkpoints (rounds "
                             f"{low:.0f} and {high:.0f}); resume with --resume "
                             f"{os.path.dirname(saved.path)}/checkpoint-<round>")
    set_peft_model_state_dict(model, saved.adapter)
    lrs = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict(saved.optimizer)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    buffer.load_state_dict(saved.buffer, temperature=saved.config.get("temperature", 1.0))
    set_rng_states(saved.rng)
    version, internal, gauss = saved.python_rng
    rng.setstate((version, tuple(internal), gauss))


def save_adapter(model, folder: str) -> None:
    """The trained LoRA adapter alone (PeftModel.from_pretrained loads it), written by rank 0."""
    if distributed.is_main():
        with full_disk_as_one_line(os.path.dirname(folder), folder):
            model.save_pretrained(folder)


def load_adapter(model, folder: str) -> None:
    """Put a saved LoRA adapter (``folder``/adapter_model.safetensors, no pickles) into a PEFT model
    that has the same adapter layout (load_policy with the same r). Raises ValueError on weights
    the model has no place for (another layout)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(os.path.join(folder, "adapter_model.safetensors"))
    unexpected = set_peft_model_state_dict(model, weights).unexpected_keys
    if unexpected:
        raise ValueError(f"{folder}: {len(unexpected)} adapter weights fit no LoRA layer of the "
                         f"model, e.g. {unexpected[0]}")


def drop_after(run_dir: str, round: int) -> None:
    """Delete the checkpoints after ``round``: resuming from an earlier one abandons them."""
    if distributed.is_main():
        for r in rounds(run_dir):
            if r > round:
                shutil.rmtree(os.path.join(run_dir, f"checkpoint-{r}"))


# ---- the run folder: one run's, written by one process at a time ------------------------------
def holds_run(run_dir: str) -> bool:
    """Whether a folder holds a run's files: its config, its metrics or a checkpoint."""
    if not os.path.isdir(run_dir):
        return False
    return any(name in ("config.json", "metrics.jsonl") or re.fullmatch(r"(\.tmp-)?checkpoint-\d+", name)
               for name in os.listdir(run_dir))


def new_run_dir(parent: str = "runs") -> str:
    """A new, empty folder parent/<time>, made here; parent/<time>-2, -3, ... when another run
    started in the same second took that name (mkdir is atomic: two runs never share one)."""
    os.makedirs(parent, exist_ok=True)
    base = os.path.join(parent, time.strftime("%Y%m%d-%H%M%S"))
    for i in range(1, 10_000):
        path = base if i == 1 else f"{base}-{i}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run folder name under {parent}")


class RunFolderBusy(Exception):
    """Another live process holds the folder's lock; the message is one line."""


_locks: dict[str, object] = {}          # lock file -> its open, locked file (this process)


def lock_folder(folder: str, name: str = ".lock", *, what: str = "a run or a resume in progress",
                other: str = "--output-dir") -> None:
    """Take the lock folder/name (an OS file lock) for as long as this process writes there; raises
    RunFolderBusy, naming the holder's pid, ``what`` it does and the flag ``other`` that picks
    another place, if another process holds it. The OS releases it on every exit, a crash or SIGKILL
    included, so a lock is never stale: the file that stays names the last process that held it,
    nothing more. train.py locks its run folder (.lock), compare.py its comparison folder, evaluate.py
    the file it writes (.eval.json.lock). Rank 0 alone (the others write no run files). Without
    fcntl (Windows) there is no lock."""
    try:
        import fcntl
    except ImportError:
        return
    path = os.path.join(folder, name)
    if not distributed.is_main() or path in _locks:
        return
    os.makedirs(folder, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunFolderBusy(f"{folder} is being written by {holder} ({what}): wait for it to end, "
                            f"or use another {other}") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    _locks[path] = f


def claim_run_folder(output_dir: str) -> str:
    """train.py's run folder, locked: output_dir, or rank 0's runs/<time> (the processes' clocks
    may straddle a second). One that another process holds is a one-line exit on every rank."""
    out = distributed.broadcast(output_dir or (new_run_dir() if distributed.is_main() else ""))
    busy = ""
    try:                                # one process writes a run folder at a time
        lock_run(out)
    except RunFolderBusy as e:
        busy = str(e)
    if busy := distributed.broadcast(busy):
        distributed.exit_all(f"error: {busy}", 2)
    return out


def lock_run(run_dir: str) -> None:
    """train.py's lock on its run folder (run_dir/.lock): see lock_folder."""
    lock_folder(run_dir)


def unlock_runs() -> None:
    """Release this process's folder locks (a run in this process ended)."""
    while _locks:
        _locks.popitem()[1].close()


class StopRequest:
    """First Ctrl-C / SIGTERM: finish the step, save, exit; a step that does not finish within
    ``grace`` seconds (a reward that hangs, say) exits without saving, naming the last checkpoint.
    A second Ctrl-C or SIGTERM exits at once."""

    def __init__(self, grace: float | None = None):
        self.signum = None              # the signal this process received
        self.agreed = None              # the signal that stops the run, once any process has one
        if grace is None:               # REPLAY_RL_STOP_GRACE: the tests' shorter grace
            grace = float(os.environ.get("REPLAY_RL_STOP_GRACE", 30))
        self.grace, self.run_dir, self.watchdog = grace, None, None
        self.previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}

    def __call__(self, signum, frame):
        self.signum = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)     # a second one: exit at once
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        distributed.print0(f"\n{signal.Signals(signum).name}: finishing this step (at most "
                           f"{self.grace:.0f} s), then saving a checkpoint (Ctrl-C again to exit at "
                           "once, without saving)", file=sys.stderr, flush=True)
        if self.watchdog is None:
            self.watchdog = threading.Timer(self.grace, self.give_up)
            self.watchdog.daemon = True
            self.watchdog.start()

    def give_up(self) -> None:
        """The step did not finish within the grace: exit now, naming what a resume starts from."""
        last = find(self.run_dir) if self.run_dir and os.path.isdir(self.run_dir) else None
        distributed.print0(f"the step did not finish within {self.grace:.0f} s of "
                           f"{signal.Signals(self.signum).name}: exited without saving; "
                           + (f"the last checkpoint is {last}: resume with "
                              f"{distributed.command(f'train.py --resume {self.run_dir}')}"
                              if last else "no checkpoint had been saved"), file=sys.stderr, flush=True)
        os._exit(128 + self.signum)

    def saving(self) -> None:
        """The step finished: the save that follows may take the time it needs."""
        if self.watchdog is not None:
            self.watchdog.cancel()

    def requested(self) -> bool:
        """Whether a signal asked to stop, in any process: all stop at the same step, or the others
        would wait for it forever (a collective: every process asks at the same points)."""
        if self.agreed is None:
            self.agreed = int(distributed.maxima({"signal": self.signum or 0})["signal"]) or None
        return self.agreed is not None

    def restore(self):
        self.saving()
        for s, handler in self.previous.items():
            signal.signal(s, handler)
