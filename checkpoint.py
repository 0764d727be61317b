"""Checkpoints: everything needed to continue a run exactly, written atomically, read back once.

    checkpoint-<round>/
        adapter/             the LoRA weights (PEFT's save_pretrained)
        optimizer.pt         AdamW's state: tensors and numbers only (read with weights_only=True)
        buffer.safetensors   the replay buffer        (with W processes, rank r > 0 adds
        rng.safetensors      torch's RNG streams       buffer-rank<r> and rng-rank<r>)
        state.json           the loop state, the prompt stream (Python's random), the config

Only tensors and JSON are read: no pickles. Also here, how a run that stops goes on: the first
Ctrl-C / SIGTERM (StopRequest), which lets the loop finish its step and save before it exits, and
the one line that names the checkpoint to resume from (how_to_go_on, disk_full_message). The run
folder these live in (one run's, one writer, a full disk as one line) is runfolder.py's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import threading
from dataclasses import dataclass, field

import torch

import distributed
import runfolder


@dataclass
class LoopState:
    """What the loop carries from round to round: its counters, and all that a checkpoint needs
    besides the weights, the optimizer, the buffer and the RNG streams (state.json: as a dict)."""
    step: int = 0                   # optimizer steps taken, skipped ones too: the policy_version of new rollouts
    round: int = 0                  # rounds generated
    gen_tokens: int = 0             # completion tokens generated (all processes)
    gen_seconds: float = 0.0        # time spent generating
    train_seconds: float = 0.0      # time spent in optimizer steps
    gen_cpu_seconds: float = 0.0    # CPU time of this process generating (runs side by side share
    train_cpu_seconds: float = 0.0  # the cores: their wall times stretch, their CPU times less so)
    skipped_steps: int = 0          # steps skipped for a NaN/inf loss or gradient
    skipped_in_a_row: int = 0       # the latest run of them (--max-skipped-steps ends the run)
    reward_errors: int = 0          # rewards that raised, scored 0 (--on-reward-error zero)
    eval_reward_errors: int = 0     # the same during evals
    pending_updates: int = 0        # updates the current round has still to take
    round_end_due: bool = False     # its end (eval, checkpoint) too: a stop cut its eval short
    round_batch_size: int = 0       # B of the current round's updates (--resume may change B)
    lapsed_updates: int = 0         # updates dropped: too few rollouts unused or young enough
    rollouts_generated: int = 0     # rollouts sampled (all processes)
    rollouts_stored: int = 0        # of them stored in the buffer (the filter, S's cap: fewer)
    rollouts_trained: int = 0       # rollouts in all batches (more than stored: replay)
    left_by_uses: list = field(default_factory=list)    # gone from the buffer by uses: [unused, once, ...]
    age_sum: float = 0.0            # the ages (steps) of the rollouts trained on, summed
    age_max: int = 0                # and the oldest
    round_stats: dict = field(default_factory=dict)     # the round's figures, logged each step
    first_accuracy: float | None = None                 # eval accuracy at step 0
    last_accuracy: float | None = None                  # at the latest eval
    last_eval_round: int = -1       # round of the latest eval
    next_eval_tokens: int = 0       # --eval-every-tokens: the next eval once gen_tokens is here
    idle_rounds: int = 0            # rounds without an update (the buffer held fewer than B)
    metrics_bytes: int = 0          # length of metrics.jsonl: a resume cuts later lines off
    world_size: int = 1             # processes, each with its own buffer shard


@dataclass
class Checkpoint:
    """A checkpoint as read back: each of its files read once, what this rank needs to continue."""
    path: str
    state: dict                         # the loop state (LoopState's fields)
    python_rng: list                    # the prompt stream: random.Random.getstate() as JSON
    config: dict                        # the run's Config
    adapter: dict[str, torch.Tensor]    # the LoRA weights
    optimizer: dict                     # the optimizer's state_dict
    buffer: dict[str, torch.Tensor] | None  # this rank's buffer shard (ReplayBuffer.state_dict);
    rng: dict[str, torch.Tensor] | None     # its torch RNG state. None: saved by fewer processes


class Damaged(Exception):
    """A checkpoint file that does not read back, as 'file (reason)'."""


def rounds(run_dir: str) -> list[int]:
    """Rounds of a run folder's checkpoint-<round> folders, in order (not the hidden ones)."""
    return sorted(int(m.group(1)) for d in os.listdir(run_dir)
                  if (m := re.fullmatch(r"checkpoint-(\d+)", d)))


def newest_first(path: str) -> list[str]:
    """[path] if it is a checkpoint, else its complete checkpoint-<round> folders, newest first.
    Never a hidden folder: a save that was killed while it swapped a round's folders is completed
    first (``settle``)."""
    if re.fullmatch(r"checkpoint-\d+", os.path.basename(path.rstrip("/"))):
        settle(os.path.dirname(path.rstrip("/")) or ".")
    if os.path.isfile(os.path.join(path, "state.json")):
        return [path.rstrip("/")]
    if not os.path.isdir(path):
        return []
    settle(path)
    return [os.path.join(path, f"checkpoint-{r}") for r in reversed(rounds(path))
            if os.path.isfile(os.path.join(path, f"checkpoint-{r}", "state.json"))]


def settle(run_dir: str) -> None:
    """Finish a save of a round already saved that was stopped within ``swap_in``. An
    .old-checkpoint-R without checkpoint-R: stopped between the two renames, the new one whole in
    .tmp-checkpoint-R (state.json is its last file); it is renamed in, as the save would have done
    next (whichever of the two comes second finds nothing to move), and the old one removed. An
    .old-checkpoint-R beside checkpoint-R, the new .tmp-checkpoint-R gone: left over, removed."""
    if not os.path.isdir(run_dir):
        return
    for name in os.listdir(run_dir):
        if not (m := re.fullmatch(r"\.old-checkpoint-(\d+)", name)):
            continue
        final = os.path.join(run_dir, f"checkpoint-{m.group(1)}")
        new = os.path.join(run_dir, f".tmp-checkpoint-{m.group(1)}")
        if os.path.exists(final):
            if not os.path.exists(new):
                shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
            continue
        if not os.path.isfile(os.path.join(new, "state.json")):
            continue
        try:
            os.replace(new, final)
        except OSError:                 # done by another process, or a folder we may not write
            continue
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


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
    batch size of the round, the rollouts generated (R per round), stored (all of them: exact
    without --skip-zero-advantage) and trained so far (B per step), zero lapsed updates and eval
    reward errors, one process."""
    B, R = config["batch_size"], config.get("prompts_per_round", 0) * config.get("num_generations", 0)
    return {"round_batch_size": B, "rollouts_trained": state["step"] * B, "lapsed_updates": 0,
            "rollouts_generated": state["round"] * R, "rollouts_stored": state["round"] * R,
            "eval_reward_errors": 0, "world_size": 1, **state}


def newest_readable(run_dir: str) -> Checkpoint | None:
    """The newest checkpoint of a run folder whose files all read back; says which were skipped."""
    for path in newest_first(run_dir):
        try:
            return read(path)
        except Damaged as e:
            distributed.print0(f"skipping {path}: damaged, {e}", file=sys.stderr)
    return None


def swap_in(new: str, final: str, old: str) -> None:
    """The complete folder ``new`` renamed to ``final``; a folder already there is first renamed
    to ``old``, then removed: no moment without one of the two complete (a folder cannot be
    renamed over another that is not empty). A stop between the two renames leaves ``old`` and
    ``new``, both whole (``settle`` puts checkpoints in place)."""
    if os.path.exists(final):
        os.replace(final, old)
    try:
        os.replace(new, final)
    except FileNotFoundError:           # settle, in another process, renamed it in
        if not os.path.isdir(final):
            raise
    except OSError:                     # the rename failed: the old one back in its place
        if os.path.isdir(old) and not os.path.exists(final):
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def save(run_dir: str, state: dict, config: dict, *, model, optimizer, buffer, rng) -> str:
    """Write everything needed to continue exactly, atomically: into a hidden temporary folder
    first, state.json last, then renamed in (``swap_in``: a round saved again replaces its folder
    only once the new one is whole). A crash or a kill at any moment leaves a complete checkpoint
    that ``find`` returns; a full disk (or another limit: runfolder.no_space) removes the
    half-written one and raises DiskFull naming the file it was writing. Every rank calls it (each
    writes its buffer shard and RNG state). state: the loop state (its round names the folder);
    config: the run's (keep_checkpoints: how many stay); rng: the prompt stream."""
    from safetensors.torch import save_file

    round = state["round"]
    final = os.path.join(run_dir, f"checkpoint-{round}")
    tmp = os.path.join(run_dir, f".tmp-checkpoint-{round}")
    old = os.path.join(run_dir, f".old-checkpoint-{round}")
    current = tmp                       # the file being written

    def to(name: str) -> str:
        nonlocal current
        current = os.path.join(tmp, name)
        return current

    with runfolder.full_disk_as_one_line(run_dir, lambda: current, cleanup=tmp):
        if distributed.is_main():       # what a killed save left (this process holds the lock)
            settle(run_dir)
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
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
            swap_in(tmp, final, old)
            for r in rounds(run_dir)[:-config["keep_checkpoints"]]:
                remove_round(run_dir, r)
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


def remove_round(run_dir: str, round: int) -> None:
    """A round's checkpoint folder, and what a killed save of it left."""
    for name in (f"checkpoint-{round}", f".tmp-checkpoint-{round}", f".old-checkpoint-{round}"):
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def save_adapter(model, folder: str) -> None:
    """The trained LoRA adapter alone (PeftModel.from_pretrained loads it), written by rank 0, whole
    or not at all: into .tmp-<name> beside it, then renamed in (swap_in); a full disk removes the
    half-written one and raises DiskFull."""
    if distributed.is_main():
        parent, name = os.path.split(folder.rstrip("/"))
        tmp, old = os.path.join(parent, f".tmp-{name}"), os.path.join(parent, f".old-{name}")
        with runfolder.full_disk_as_one_line(parent, tmp, cleanup=tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
            model.save_pretrained(tmp)
            swap_in(tmp, folder, old)


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
        for name in os.listdir(run_dir):
            m = re.fullmatch(r"(\.tmp-|\.old-)?checkpoint-(\d+)", name)
            if m and int(m.group(2)) > round:
                remove_round(run_dir, int(m.group(2)))


# ---- a run that stops: how it goes on, and the first Ctrl-C -------------------------------------
def disk_full_message(e: runfolder.DiskFull) -> str:
    """One line: the limit, the file, the disk, the last checkpoint (intact) and how to go on."""
    where, fix = runfolder.limit_in_words(e.reason, e.run_dir)
    last = find(e.run_dir) if os.path.isdir(e.run_dir) else None
    resume = distributed.command(f"train.py --resume {e.run_dir}")
    then = (f"the last checkpoint, {last}, is intact: {fix}, then {resume}" if last else
            f"no checkpoint yet: {fix}, then {resume} starts the run again from its config"
            if os.path.isfile(os.path.join(e.run_dir, "config.json")) else
            f"nothing of the run was saved yet: {fix} and start it again")
    return f"{e.reason}: {e.path} could not be written ({where}); {then}"


class Interrupted(BaseException):
    """A generation or an eval cut short by the first Ctrl-C / SIGTERM (StopRequest.abortable).
    The loop puts back what it held before that phase and saves: a resume does it again. A
    BaseException, so that a reward's ``except Exception`` cannot swallow it."""


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


class StopRequest:
    """The first Ctrl-C / SIGTERM: stop at the next safe point and save a checkpoint there. A
    generation or an eval under way is cut short at once (it runs inside ``abortable``, which
    raises Interrupted; the loop saves the state from before it, and a resume does it again); an
    optimizer step is let finish (seconds). A step that does not finish within ``grace`` seconds
    exits without saving, naming how the run goes on. A second Ctrl-C or SIGTERM exits at once.
    With torchrun nothing is cut short (every process must reach the same collectives): each
    finishes its phase first."""

    def __init__(self, grace: float | None = None):
        self.signum = None              # the signal this process received
        self.agreed = None              # the signal that stops the run, once any process has one
        if grace is None:               # REPLAY_RL_STOP_GRACE: the tests' shorter grace
            grace = float(os.environ.get("REPLAY_RL_STOP_GRACE", 30))
        self.grace, self.run_dir, self.watchdog = grace, None, None
        self.cutting = False            # inside ``abortable``: the signal raises Interrupted there
        self.second = None              # the second signal, which exits at once
        self.previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}

    def __call__(self, signum, frame):
        self.signum = signum
        signal.signal(signal.SIGINT, self.again)        # a second one: exit at once
        signal.signal(signal.SIGTERM, self.again)
        distributed.print0(f"\n{signal.Signals(signum).name}: stopping at the next safe point to "
                           "save a checkpoint (a generation or an eval under way is cut short and "
                           f"done again on resume; a step gets at most {self.grace:.0f} s). Ctrl-C "
                           "again to exit at once, without saving", file=sys.stderr, flush=True)
        if self.watchdog is None:
            self.watchdog = threading.Timer(self.grace, self.give_up)
            self.watchdog.daemon = True
            self.watchdog.start()
        if self.cutting:
            self.cutting = False
            raise Interrupted(signal.Signals(signum).name)

    def again(self, signum, frame):
        """The second signal: KeyboardInterrupt, wherever the run is (train.main exits, naming how
        the run goes on, with 128 + this signal)."""
        self.second = signum
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def abortable(self, state=None, rng=None):
        """A phase the first signal cuts short: within this block it raises Interrupted (at once if
        a signal came before), after putting back what the phase had changed, as it was when the
        block began: ``state`` (a dataclass, field by field), ``rng`` (a random.Random) and torch's
        RNG streams; a save and a resume then see the phase as not begun. One process only: with
        torchrun the block runs to its end."""
        if distributed.world_size() > 1:
            yield
            return
        before = (dataclasses.asdict(state) if state is not None else {},
                  rng.getstate() if rng is not None else None, rng_states())
        try:
            if self.signum is not None:
                raise Interrupted(signal.Signals(self.signum).name)
            self.cutting = True
            yield
        except Interrupted:
            for name, value in before[0].items():
                setattr(state, name, value)
            if rng is not None:
                rng.setstate(before[1])
            set_rng_states(before[2])
            raise
        finally:
            self.cutting = False

    def give_up(self) -> None:
        """The step (or, before the run folder exists, the model's loading) did not finish within
        the grace: exit now, naming how the run goes on."""
        what = "the step" if self.run_dir else "loading (or building) the model"
        distributed.print0(f"{what} did not finish within {self.grace:.0f} s of "
                           f"{signal.Signals(self.signum).name}: exited without saving; "
                           + how_to_go_on(self.run_dir), file=sys.stderr, flush=True)
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
