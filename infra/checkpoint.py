"""Checkpoints: everything needed to continue a run exactly, written atomically, read back once.

    checkpoint-<round>/
        adapter/             the LoRA weights (PEFT's save_pretrained)
        optimizer.pt         AdamW's state: tensors and numbers only (read with weights_only=True)
        buffer.safetensors   the replay buffer        (with W processes, rank r > 0 adds
        rng.safetensors      torch's RNG streams       buffer-rank<r> and rng-rank<r>)
        state.json           the loop state, the prompt stream (Python's random), the config

Only tensors and JSON are read: no pickles, and what is read is checked before it is trusted
(``contents_problem``: a damaged checkpoint is skipped for the newest intact one). How a run that
stops goes on (the first Ctrl-C, every other ending) is stopping.py's; the run folder these live in
(one run's, one writer, a full disk as one line) is runfolder.py's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass, field

import torch

from buffer import buffer_state, load_buffer_state
from infra import distributed
from infra import runfolder


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
    eval_seconds: float = 0.0       # time spent in evals (wall; its CPU time below)
    eval_cpu_seconds: float = 0.0
    skipped_steps: int = 0          # steps skipped for a NaN/inf loss or gradient
    skipped_in_a_row: int = 0       # the latest run of them (--max-skipped-steps ends the run)
    reward_errors: int = 0          # rewards that raised, scored 0 (--on-reward-error zero)
    eval_reward_errors: int = 0     # the same during evals
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
    # --generators W (async_rl.py): the trainer's own clock and what the processes waited for
    new_since_step: int = 0         # rollouts stored since the last step (S counts them)
    retired_at_cap: int = 0         # rollouts that left the buffer at --max-uses (async)
    wall_seconds: float = 0.0       # the loop's wall time, evals excluded (report.Report.tick)
    trainer_wait_seconds: float = 0.0           # the trainer waiting for rollouts
    worker_weights_wait_seconds: float = 0.0    # the workers waiting for newer weights (summed)
    worker_room_wait_seconds: float = 0.0       # the workers waiting for an order: no room


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


class NewerVersion(Exception):
    """A checkpoint written by a newer version of this code (its loop state has a field this one
    does not know): never damaged, never skipped for an older one; resumed by that version."""


# Loop-state fields of earlier versions, dropped when their checkpoints are read: a round cut short
# was saved mid-round then (its updates still to take); now every checkpoint is a round's end.
RETIRED_FIELDS = ("pending_updates", "round_end_due", "round_batch_size")


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
    .old-checkpoint-<round> without checkpoint-<round>: stopped between the two renames, the new
    one whole in .tmp-checkpoint-<round> (state.json is its last file); it is renamed in, as the
    save would have done next (whichever of the two comes second finds nothing to move), and the
    old one removed. An .old-checkpoint-<round> beside checkpoint-<round>, the new
    .tmp-checkpoint-<round> gone: left over, removed."""
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


def read(path: str, check=None) -> Checkpoint:
    """Every file of a checkpoint, read once: this rank's loaded, the other ranks' shards checked
    (their header and size), so that every rank judges a checkpoint alike; then its contents
    checked (``contents_problem``; check: a function of the Checkpoint giving a further problem
    or None, e.g. token ids against the model's vocabulary). Raises Damaged."""
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
    if isinstance(saved, dict) and isinstance(saved.get("state"), dict):
        known = {f.name for f in dataclasses.fields(LoopState)} | set(RETIRED_FIELDS)
        if newer := sorted(set(saved["state"]) - known):
            raise NewerVersion(f"{path.rstrip('/')} was written by a newer version of replay-rl "
                               f"(its loop state has {newer[0]!r}, which this version does not "
                               "know): resume it with the version that wrote it")
    if problem := saved_problem(saved):
        raise Damaged(f"state.json ({problem})")
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
    found = Checkpoint(path.rstrip("/"), upgraded(saved["state"], saved["config"]),
                       saved["python_rng"], saved["config"], adapter, optimizer,
                       shards.get("buffer"), shards.get("rng"))
    if problem := contents_problem(found) or (check and check(found)):
        raise Damaged(problem)
    return found


def upgraded(state: dict, config: dict) -> dict:
    """A loop state as state.json holds it, without the fields earlier versions kept
    (RETIRED_FIELDS), with those that older checkpoints lack: the rollouts generated (R per round), stored (all of them: exact
    without --skip-zero-advantage) and trained so far (B per step), zero lapsed updates and eval
    reward errors, one process."""
    B, R = config["batch_size"], config.get("prompts_per_round", 0) * config.get("num_generations", 0)
    state = {k: v for k, v in state.items() if k not in RETIRED_FIELDS}
    return {"rollouts_trained": state["step"] * B, "lapsed_updates": 0,
            "rollouts_generated": state["round"] * R, "rollouts_stored": state["round"] * R,
            "eval_reward_errors": 0, "world_size": 1, **state}


# ---- a checkpoint's contents, checked before they are trusted ------------------------------------
BUFFER_KEYS = ("prompt_ids", "prompt_lens", "completion_ids", "behaviour_logp", "completion_lens",
               "reward", "advantage", "policy_version", "baseline", "uses", "generator_state")
PER_ROLLOUT = ("completion_lens", "reward", "advantage", "policy_version", "baseline", "uses",
               "temperature")


def saved_problem(saved) -> str | None:
    """Why state.json's contents cannot be a loop state to go on from, or None: its parts, each
    LoopState field's type (numbers finite; the step and the round >= 0), the prompt stream."""
    if not isinstance(saved, dict) or not {"state", "python_rng", "config"} <= saved.keys():
        return "not a saved loop state"
    state, config = saved["state"], saved["config"]
    if not isinstance(state, dict) or not isinstance(config, dict):
        return "not a saved loop state"
    kinds = {f.name: f.type for f in dataclasses.fields(LoopState)}
    for name in ("step", "round"):
        if not isinstance(state.get(name), int) or state[name] < 0:
            return f"the loop state's {name} is {state.get(name)!r}, not an int >= 0"
    for name, value in state.items():
        kind = kinds.get(name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        fits = {"int": isinstance(value, int) and not isinstance(value, bool),
                "float": number and math.isfinite(value),
                "float | None": value is None or number and math.isfinite(value),
                "bool": isinstance(value, bool), "dict": isinstance(value, dict),
                "list": isinstance(value, list) and all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)}
        if kind is None and name in RETIRED_FIELDS:     # an earlier version's: upgraded drops it
            continue
        if kind is None:
            return f"the loop state has an unknown field {name!r}"
        if not fits.get(kind, True):
            return f"the loop state's {name} is {value!r}, not {kind}"
    try:
        version, internal, gauss = saved["python_rng"]
        random.Random().setstate((version, tuple(internal), gauss))
    except (TypeError, ValueError) as e:
        return f"the prompt stream does not read back ({e})"
    B = config.get("batch_size")
    if not isinstance(B, int) or isinstance(B, bool) or B <= 0:
        return f"the config's batch_size is {B!r}"
    return None


def contents_problem(saved: Checkpoint) -> str | None:
    """Why a checkpoint whose files read back still cannot be trusted, as 'file (reason)', or None:
    its buffer shard (``buffer_problem``), its RNG streams, and NaN/inf in the adapter or the
    optimizer state."""
    if saved.buffer is not None and (problem := buffer_problem(saved.buffer, saved.config,
                                                               saved.state["step"])):
        return f"{shard_name('buffer', distributed.rank())} ({problem})"
    if saved.rng is not None:
        torch_rng = saved.rng.get("torch")
        if torch_rng is None or torch_rng.dtype != torch.uint8 or (
                torch_rng.shape != torch.get_rng_state().shape):
            return f"{shard_name('rng', distributed.rank())} (not torch's RNG state)"
    if bad := [k for k, t in saved.adapter.items() if t.is_floating_point() and
               not torch.isfinite(t).all()]:
        return f"adapter/adapter_model.safetensors ({bad[0]} holds NaN or inf)"
    tensors = [t for entry in saved.optimizer.get("state", {}).values() if isinstance(entry, dict)
               for t in entry.values() if isinstance(t, torch.Tensor)]
    if not isinstance(saved.optimizer.get("param_groups"), list) or any(
            t.is_floating_point() and not torch.isfinite(t).all() for t in tensors):
        return "optimizer.pt (not an optimizer state with finite numbers)"
    return None


def buffer_problem(buffer: dict, config: dict, step: int) -> str | None:
    """Why a buffer shard (ReplayBuffer.state_dict) cannot be loaded and trained on, or None: a
    missing key, a tensor of the wrong kind, lengths that do not add up, more rollouts than the
    buffer holds, a negative token id, log-probs that are not finite or above 0, rewards and
    baselines that are not finite, advantages beyond what a group of G gives
    (|A| <= (G - 1) / sqrt(G) for A = (r - mean) / (sample std + 1e-4)), a policy version after
    the checkpoint's step. Token ids against the vocabulary: ``tokens_problem``, once it is
    known."""
    if missing := [k for k in BUFFER_KEYS if k not in buffer]:
        return f"no {missing[0]}"
    if flat := [k for k, t in buffer.items() if t.dim() != 1]:
        return f"{flat[0]} is not a list of numbers"
    integer = lambda t: not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    ints = ("prompt_ids", "prompt_lens", "completion_ids", "completion_lens", "policy_version",
            "uses", "left_by_uses")
    if wrong := [k for k in ints if k in buffer and not integer(buffer[k])]:
        return f"{wrong[0]} holds {buffer[wrong[0]].dtype}, not integers"
    floats = ("behaviour_logp", "reward", "advantage", "baseline", "temperature")
    if wrong := [k for k in floats if k in buffer and not buffer[k].is_floating_point()]:
        return f"{wrong[0]} holds {buffer[wrong[0]].dtype}, not real numbers"
    n = len(buffer["prompt_lens"])
    if wrong := [k for k in PER_ROLLOUT if k in buffer and len(buffer[k]) != n]:
        return f"{wrong[0]} has {len(buffer[wrong[0]])} values for {n} rollouts"
    if n > config.get("buffer_size", n):
        return f"{n} rollouts, more than the buffer's {config['buffer_size']}"
    for ids, lens in (("prompt_ids", "prompt_lens"), ("completion_ids", "completion_lens")):
        if (buffer[lens] < 0).any() or int(buffer[lens].sum()) != len(buffer[ids]):
            return f"{lens} do not add up to the {len(buffer[ids])} tokens of {ids}"
        if len(buffer[ids]) and int(buffer[ids].min()) < 0:
            return f"{ids} holds a negative token id"
    if len(buffer["behaviour_logp"]) != len(buffer["completion_ids"]):
        return (f"{len(buffer['behaviour_logp'])} behaviour log-probs for "
                f"{len(buffer['completion_ids'])} completion tokens")
    logp = buffer["behaviour_logp"]
    if not torch.isfinite(logp).all() or (len(logp) and float(logp.max()) > 1e-4):
        return "behaviour_logp holds NaN, inf or a log-prob above 0"
    for k in ("reward", "baseline"):
        if not torch.isfinite(buffer[k]).all():
            return f"{k} holds NaN or inf"
    G = config.get("num_generations", 1)
    bound = (G - 1) / G ** 0.5 + 1e-3 if isinstance(G, int) and G > 0 else math.inf
    if not torch.isfinite(buffer["advantage"]).all() or (
            n and float(buffer["advantage"].abs().max()) > bound):
        return (f"advantage holds NaN, inf or a value beyond {bound:.3f} (a group of G = {G} "
                "gives no more)")
    if "temperature" in buffer and not (torch.isfinite(buffer["temperature"]).all()
                                        and (buffer["temperature"] > 0).all()):
        return "temperature holds a value that is not a finite number > 0"
    versions = buffer["policy_version"]
    if n and (int(versions.min()) < 0 or int(versions.max()) > step):
        return f"policy_version holds a step outside 0..{step}"
    if any((buffer[k] < 0).any() for k in ("uses", "left_by_uses") if k in buffer):
        return "a negative use count"
    generator = buffer["generator_state"]
    if generator.dtype != torch.uint8 or generator.shape != torch.Generator().get_state().shape:
        return "generator_state is not a torch.Generator's state"
    return None


def tokens_problem(buffer: dict | None, vocab_size: int | None) -> str | None:
    """Why a buffer shard's token ids do not fit a vocabulary of ``vocab_size`` (ids 0 ..
    vocab_size - 1), or None (also when either is unknown)."""
    if buffer is None or not vocab_size:
        return None
    for ids in ("prompt_ids", "completion_ids"):
        if len(buffer[ids]) and int(buffer[ids].max()) >= vocab_size:
            return (f"{shard_name('buffer', distributed.rank())} ({ids} holds token id "
                    f"{int(buffer[ids].max())}, past the model's vocabulary of {vocab_size})")
    return None


def model_vocab_size(model) -> int:
    """Rows of the model's input embedding: token ids must be below it."""
    return model.get_input_embeddings().num_embeddings


def newest_readable(run_dir: str, check=None) -> Checkpoint | None:
    """The newest checkpoint of a run folder that reads back and whose contents pass (``read``,
    with ``check``); says which were skipped and why."""
    for path in newest_first(run_dir):
        try:
            return read(path, check)
        except Damaged as e:
            distributed.print0(f"skipping {path}: damaged, {e}", file=sys.stderr)
    return None


def no_intact_checkpoint(run_dir: str) -> str:
    """The way forward from a run folder none of whose checkpoints is intact, in words with
    commands that work as printed: move the checkpoints aside, then --resume starts the run again
    from its config.json, in this folder; without a config.json, a new run elsewhere."""
    import shlex

    if not os.path.isfile(os.path.join(run_dir, "config.json")):
        return ("no checkpoint there is intact, and no config.json to start the run again from: "
                "start a new run with another --output-dir")
    aside = os.path.join(run_dir, "damaged")
    for i in range(2, 1000):
        if not os.path.exists(aside):
            break
        aside = os.path.join(run_dir, f"damaged-{i}")
    damaged = [os.path.join(run_dir, f"checkpoint-{r}") for r in rounds(run_dir)]
    quoted = " ".join(map(shlex.quote, damaged))
    move = f"mkdir {shlex.quote(aside)} && mv {quoted} {shlex.quote(aside)}/"
    again = distributed.command(f"train.py --resume {shlex.quote(run_dir)}")
    return (f"no checkpoint there is intact; to start the run again from its config.json in "
            f"this folder, move them aside: {move}, then: {again}")


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


def save(run_dir: str, state: dict, config: dict, *, model, optimizer, buffer, rng,
         torch_rng: dict | None = None, weights: dict | None = None) -> str:
    """Write everything needed to continue exactly, atomically: into a hidden temporary folder
    first, state.json last, then renamed in (``swap_in``: a round saved again replaces its folder
    only once the new one is whole). A crash or a kill at any moment leaves a complete checkpoint
    that ``find`` returns; a full disk (or another limit: runfolder.no_space) removes the
    half-written one and raises DiskFull naming the file it was writing; any other exception (a
    second Ctrl-C) removes it too, and a second signal waits while the folders are swapped. Only
    the run's own process saves (runfolder.check_writer: not a child forked from it). Every rank
    calls it (each writes its buffer shard and RNG state). state: the loop state (its round names
    the folder); config: the run's (keep_checkpoints: how many stay); rng: the prompt stream;
    torch_rng: torch's RNG streams to save (rng_states(); default: as they are now); weights: the
    trainable weights to save by name (default: the model's own); optimizer: an optimizer, or its
    state_dict (a copy taken earlier)."""
    from safetensors.torch import save_file

    runfolder.check_writer(run_dir)
    round = state["round"]
    final = os.path.join(run_dir, f"checkpoint-{round}")
    tmp = os.path.join(run_dir, f".tmp-checkpoint-{round}")
    old = os.path.join(run_dir, f".old-checkpoint-{round}")
    current = tmp                       # the file being written

    def to(name: str) -> str:
        nonlocal current
        current = os.path.join(tmp, name)
        return current

    try:            # the limit is judged (full_disk_as_one_line) before anything is removed
        with runfolder.full_disk_as_one_line(run_dir, lambda: current, cleanup=tmp):
            if distributed.is_main():   # what a killed save left (this process holds the lock)
                settle(run_dir)
                for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
                    if re.fullmatch(r"\.tmp-checkpoint-\d+", name):
                        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
                shutil.rmtree(old, ignore_errors=True)
                os.makedirs(tmp)
            distributed.barrier()
            save_file(buffer_state(buffer), to(shard_name("buffer", distributed.rank())))
            save_file(torch_rng or rng_states(), to(shard_name("rng", distributed.rank())))
            distributed.barrier()
            if distributed.is_main():   # weights and optimizer state: the same on every rank
                model.save_pretrained(to("adapter"), **({"state_dict": weights} if weights else {}))
                torch.save(optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),
                           to("optimizer.pt"))
                with open(to("state.json"), "w") as f:
                    json.dump({"state": state, "python_rng": rng.getstate(), "config": config}, f)
    except BaseException:               # a second Ctrl-C, an error: nothing half-written stays
        if distributed.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if distributed.is_main():
        with signals_held():            # a second Ctrl-C waits: never between the two renames
            swap_in(tmp, final, old)
        left = [path for r in rounds(run_dir)[:-config["keep_checkpoints"]]
                for path in remove_round(run_dir, r)]
        if os.path.exists(old):         # swap_in could not remove the one it replaced
            left.append(f"{old} (not removed)")
        if left:                        # the checkpoint is whole; only the old ones stay
            distributed.print0(f"checkpoint: saved {final}, but could not remove "
                               f"{', '.join(left)}; remove them by hand", file=sys.stderr)
    distributed.barrier()
    return final


_holding = [0]          # inside signals_held(): > 0
_deferred: list = []    # a second signal that came meanwhile: raised at the block's end


@contextlib.contextmanager
def signals_held():
    """A block that a second Ctrl-C / SIGTERM does not cut (stopping.StopRequest.again asks
    ``deferred``; the KeyboardInterrupt comes at the block's end): the renames of a checkpoint's
    folders."""
    _holding[0] += 1
    try:
        yield
    finally:
        _holding[0] -= 1
    if not _holding[0] and _deferred:
        _deferred.clear()
        raise KeyboardInterrupt


def deferred(signum: int) -> bool:
    """Whether a signal's KeyboardInterrupt waits for the end of a ``signals_held`` block."""
    if _holding[0]:
        _deferred.append(signum)
    return bool(_holding[0])


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
    ranks hold checkpoints of different rounds; raises Damaged if the buffer holds token ids past
    the model's vocabulary (cli.py checks them before, where it can read the vocabulary)."""
    from peft import set_peft_model_state_dict

    at = {"round": saved.state["round"]}
    low, high = distributed.minima(at)["round"], distributed.maxima(at)["round"]
    if low != high:
        distributed.exit_all(f"error: the processes resumed from different checkpoints (rounds "
                             f"{low:.0f} and {high:.0f}); resume with --resume "
                             f"{os.path.dirname(saved.path)}/checkpoint-<round>")
    if problem := tokens_problem(saved.buffer, model_vocab_size(model)):   # unknown before: now
        raise Damaged(f"{saved.path}: {problem}; resume from an older checkpoint of "
                      f"{os.path.dirname(saved.path)} (--resume RUN/checkpoint-<round>)")
    set_peft_model_state_dict(model, saved.adapter)
    lrs = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict(saved.optimizer)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    load_buffer_state(buffer, saved.buffer, temperature=saved.config.get("temperature", 1.0))
    set_rng_states(saved.rng)
    version, internal, gauss = saved.python_rng
    rng.setstate((version, tuple(internal), gauss))


def remove_round(run_dir: str, round: int) -> list[str]:
    """A round's checkpoint folder, and what a killed save of it left. Returns what could not be
    removed, as 'path (reason)' (too many open files, a folder not ours, ...)."""
    left = []
    for name in (f"checkpoint-{round}", f".tmp-checkpoint-{round}", f".old-checkpoint-{round}"):
        path = os.path.join(run_dir, name)
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            left.append(f"{path} ({e.strerror or e})")
    return left


def optimizer_file_size(optimizer) -> int | None:
    """The bytes of optimizer.pt as ``save`` writes it once the optimizer has its state: measured,
    by one step of an optimizer of the same kind and settings on zeros of the same shapes (before
    its first step the run's own holds no state), written with torch.save to a file of that name
    in a temporary folder (in memory where the system has one, /dev/shm), then removed. (In memory
    torch.save names the zip's entries otherwise, and its padding follows the names.) None: the
    file stopped at this process's file-size limit (ulimit -f) before it was whole."""
    import tempfile
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [torch.zeros_like(p, device="cpu", requires_grad=True)
                          for p in group["params"]]} for group in optimizer.param_groups]
    shadow = type(optimizer)(groups)
    for group in shadow.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    shadow.step()
    where = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=where) as folder:
        path = os.path.join(folder, "optimizer.pt")
        try:
            torch.save(shadow.state_dict(), path)
        except Exception:       # torch.save reports a write the limit stopped as a RuntimeError
            limit = runfolder.file_size_limit()
            if limit is not None and os.path.getsize(path) >= limit:
                return None
            raise
        return os.path.getsize(path)


def check_file_size_limit(optimizer) -> None:
    """Before the first round: the largest file a checkpoint writes, the optimizer's state
    (optimizer_file_size, measured), must fit under this process's file-size limit (ulimit -f), or
    every save of the run would fail, the first of them at its end."""
    limit = runfolder.file_size_limit()
    if limit is None:
        return
    need = optimizer_file_size(optimizer)
    if need is not None and need <= limit:
        return
    takes = f"more than {limit:,}" if need is None else f"{need:,}"
    raise SystemExit(f"error: {runfolder.FILE_SIZE_LIMIT}: this process may write no file over "
                     f"{limit} bytes, and a checkpoint's optimizer state takes {takes} (measured): "
                     "raise it (ulimit -f) and run again (nothing was trained)")


def save_adapter(model, folder: str) -> None:
    """The trained LoRA adapter alone (PeftModel.from_pretrained loads it), written by rank 0 of
    the run's own process (runfolder.check_writer), whole or not at all: into .tmp-<name> beside
    it, then renamed in (swap_in); a full disk or any other exception removes the half-written
    one (a full disk raises DiskFull)."""
    if distributed.is_main():
        parent, name = os.path.split(folder.rstrip("/"))
        runfolder.check_writer(parent)
        tmp, old = os.path.join(parent, f".tmp-{name}"), os.path.join(parent, f".old-{name}")
        try:        # the limit is judged (full_disk_as_one_line) before anything is removed
            with runfolder.full_disk_as_one_line(parent, tmp, cleanup=tmp):
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(old, ignore_errors=True)
                model.save_pretrained(tmp)
        except BaseException:           # a second Ctrl-C, an error: nothing half-written stays
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with signals_held():
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
