"""Several processes (torchrun), behind a few named calls: each generates, keeps, samples its share.

Data parallel over W processes (ranks): R, N and B stay global; each rank generates R/W rollouts
from its share of the round's prompts (whole groups, so advantages are computed where the group
lives), keeps a buffer shard of N/W and samples B/W per update; replay_rl.update_step_engineered sums the
gradients over the ranks. One process (plain `python train.py`) never touches torch.distributed:
every call here is then the identity, or does nothing.
"""
from __future__ import annotations

import os
import sys

import torch


def world_size() -> int:
    """Processes in the job: torchrun's WORLD_SIZE, 1 for a plain `python train.py`."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's place in the job (0 .. W-1): torchrun's RANK."""
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0: the process that writes the run folder's shared files and prints."""
    return rank() == 0


def pick_device(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def init(device: str = "auto") -> tuple[str, int, int]:
    """(this process's device, its rank, the number of processes W). Under torchrun it first joins
    the process group: nccl for GPU tensors (each rank on its own GPU, LOCAL_RANK), gloo for CPU
    tensors (the small figures, and everything on a CPU)."""
    device = pick_device(device)
    if world_size() == 1:
        return device, 0, 1
    import torch.distributed as dist
    if not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    return device, dist.get_rank(), dist.get_world_size()


def share(items: list) -> list:
    """This rank's share of a list that every rank holds alike: items r, r + W, r + 2W, ..."""
    return items[rank()::world_size()]


def share_size(n: int) -> int:
    """This rank's part of a global count (B, N: multiples of W, checked with the config)."""
    return n // world_size()


def sums(figures: dict[str, float]) -> dict[str, float]:
    """Each figure summed over the ranks (one all_reduce, in float64)."""
    return dict(zip(figures, _all_reduce(list(figures.values()), "sum")))


def means(figures: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Weighted means over the ranks, {name: (this rank's mean, its weight)} -> sum(mean * weight)
    / sum(weight) (0 where the weights sum to 0), in one all_reduce."""
    n = len(figures)
    weights = [w for _, w in figures.values()]
    totals = _all_reduce([m * w for m, w in figures.values()] + weights, "sum")
    return {k: t / w if w else 0.0 for k, t, w in zip(figures, totals[:n], totals[n:])}


def minima(figures: dict[str, float]) -> dict[str, float]:
    return dict(zip(figures, _all_reduce(list(figures.values()), "min")))


def maxima(figures: dict[str, float]) -> dict[str, float]:
    return dict(zip(figures, _all_reduce(list(figures.values()), "max")))


def every_rank(flag: bool) -> bool:
    """Whether flag holds on every rank (each rank must call it: a collective)."""
    return _all_reduce([flag], "min")[0] > 0


def _all_reduce(values: list[float], op: str) -> list[float]:
    """values summed ("sum"), or their "min" / "max", over the ranks; as floats in one process."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ops = {"sum": torch.distributed.ReduceOp.SUM, "min": torch.distributed.ReduceOp.MIN,
               "max": torch.distributed.ReduceOp.MAX}
        torch.distributed.all_reduce(t, op=ops[op])
    return t.tolist()


def broadcast(obj):
    """Rank 0's value of a picklable object, on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_tensors(tensors: list[torch.Tensor]) -> None:
    """Overwrite each tensor in place with rank 0's."""
    if world_size() > 1:
        for t in tensors:
            torch.distributed.broadcast(t, src=0)


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


def close() -> None:
    """The end of a run under torchrun: each rank waits for the others, then leaves the group. A
    rank that exits while another still works can abort in gloo's teardown (SIGABRT, "terminate
    called without an active exception"), and torchrun then reports the job failed."""
    if world_size() > 1 and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def print0(*args, **kwargs) -> None:
    """print, on rank 0 only (W processes would print every line W times)."""
    if is_main():
        print(*args, **kwargs)


def exit_all(message: str, code: int = 1) -> None:
    """Exit with ``code``, the message on stderr printed by rank 0 alone: for the errors that every
    rank reaches alike (a bad flag, a damaged checkpoint), which W processes would print W times."""
    print0(message, file=sys.stderr)
    sys.exit(code)


def command(args: str) -> str:
    """The command line that runs ``args`` (e.g. "train.py --resume RUN") as this job runs:
    python in one process, torchrun with as many processes (per node) under torchrun."""
    W, per_node = world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    if W == 1:
        return f"python {args}"
    nodes = f"--nnodes {W // per_node} " if per_node != W else ""
    return f"torchrun {nodes}--nproc-per-node {per_node} {args}"
