"""The run folder: one run's, written by one process at a time, each file whole or not at all.

A new run never goes into a folder that holds another run's files (``holds_run``), default names
are unique (``new_run_dir``; absolute), and the process that writes a run folder holds its lock
(``lock_run``; compare.py and evaluate.py lock what they write with ``lock_folder``); a process
forked from it writes nothing there (``check_writer``). JSON files are written whole
or not at all (``write_json``). A write that a full disk, a quota or the file size limit stops is
recognised whatever raised it (``no_space``) and becomes one line: ``full_disk_as_one_line`` raises
DiskFull, which train.py words with stopping.disk_full_message (naming the checkpoint to resume
from).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time

from infra import distributed


# ---- one run's, one writer at a time -----------------------------------------------------------
def holds_run(run_dir: str) -> bool:
    """Whether a folder holds a run's files: its config, its metrics or a checkpoint."""
    if not os.path.isdir(run_dir):
        return False
    return any(name in ("config.json", "metrics.jsonl")
               or re.fullmatch(r"(\.tmp-|\.old-)?checkpoint-\d+", name)
               for name in os.listdir(run_dir))


def new_run_dir(parent: str = "runs") -> str:
    """A new, empty folder parent/<time>, made here, as an absolute path (a reward that changes
    the working directory moves nothing); parent/<time>-2, -3, ... when another run started in
    the same second took that name (mkdir is atomic: two runs never share one)."""
    parent = os.path.abspath(parent)
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


_locks: dict[str, int] = {}             # lock file -> its open, locked descriptor (this process)
# lock file -> the pid that locked it: a process forked from it inherits this dict, not the lock
_writers: dict[str, int] = {}


def lock_folder(folder: str, name: str = ".lock", *, what: str = "a run or a resume in progress",
                other: str = "--output-dir") -> None:
    """Take the lock folder/name (an OS file lock) for as long as this process writes there; raises
    RunFolderBusy, naming the holder's pid, ``what`` it does and the flag ``other`` that picks
    another place, if another process holds it (DiskFull if the lock file cannot be written). A
    POSIX record lock (lockf): the OS releases it when this process ends, however it ends (a crash,
    SIGKILL), even while processes it forked live on (they do not inherit it), so a lock is never
    stale: the file that stays names the last process that held it, nothing more. Such a lock also
    ends when this process closes any descriptor of the lock file, so the one opened here stays
    open and the file is opened nowhere else. train.py locks its run folder (.lock), compare.py its
    comparison folder, evaluate.py the file it writes (.eval.json.lock). Rank 0 alone (the others
    write no run files). Without fcntl (Windows) there is no lock."""
    try:
        import fcntl
    except ImportError:
        return
    path = os.path.realpath(os.path.join(folder, name))
    if not distributed.is_main() or path in _locks:
        return
    with full_disk_as_one_line(folder, path):
        os.makedirs(folder, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 100).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunFolderBusy(f"{folder} is being written by {holder} ({what}): wait for it to end, "
                            f"or use another {other}") from None
    _locks[path], _writers[path] = fd, os.getpid()
    with full_disk_as_one_line(folder, path):   # unbuffered: nothing is left to flush at exit
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}\n".encode())


def claim_run_folder(output_dir: str) -> str:
    """train.py's run folder, locked, as an absolute path: output_dir, or rank 0's runs/<time>
    (the processes' clocks may straddle a second). One that another process holds, or that
    cannot be written (a file, a read-only disk, a folder we may not write), is a one-line exit
    on every rank."""
    busy, out = "", os.path.abspath(output_dir) if output_dir else ""
    try:                                # one process writes a run folder at a time
        out = distributed.broadcast(out or (new_run_dir() if distributed.is_main() else ""))
        lock_run(out)
    except RunFolderBusy as e:
        busy = str(e)
    except OSError as e:                # DiskFull is no OSError: its own line (train.py)
        busy = unwritable(out or os.path.abspath("runs"), e)
    if busy := distributed.broadcast(busy):
        distributed.exit_all(f"error: {busy}", 2)
    return out


def unwritable(folder: str, e: OSError) -> str:
    """One line: why a run folder cannot be written (the OS's words), and what to do."""
    what = ("is a file, not a folder" if os.path.isfile(folder) else
            f"cannot be written ({e.strerror or type(e).__name__}"
            + (f": {e.filename}" if e.filename and e.filename != folder else "") + ")")
    return f"--output-dir {folder}: {what}; give another --output-dir"


class NotTheWriter(RuntimeError):
    """A write into a run folder from a process that does not hold its lock: a process forked
    from the run (a reward's child, a worker) never writes into the run's folder."""


def check_writer(folder: str) -> None:
    """Raise NotTheWriter if this process was forked from the one that locked ``folder``: only
    the run's own process saves, writes metrics or the adapter (a child of a reward that forks
    runs a copy of the trainer, stop handler and all). A folder no process here locked is free
    (tests and tools write checkpoints without a run)."""
    owner = _writers.get(os.path.realpath(os.path.join(folder, ".lock")))
    if owner is not None and owner != os.getpid():
        raise NotTheWriter(f"pid {os.getpid()} may not write into {folder}: the run's own process "
                           f"(pid {owner}) writes it, a process forked from it never does")


def lock_run(run_dir: str) -> None:
    """train.py's lock on its run folder (run_dir/.lock): see lock_folder."""
    lock_folder(run_dir)


def unlock_runs() -> None:
    """Release this process's folder locks (a run in this process ended)."""
    while _locks:
        path, fd = _locks.popitem()
        if _writers.get(path) == os.getpid():   # a forked child closes its copy, stays no writer
            del _writers[path]
        os.close(fd)


# ---- whole or not at all, and a full disk in one line -----------------------------------------
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


DISK_FULL = "the disk is full"
QUOTA = "the disk quota is exceeded"
FILE_SIZE_LIMIT = "the file size limit is reached"


class DiskFull(Exception):
    """A write stopped by a limit of the file system (``no_space``): ``path`` the file, ``run_dir``
    its run folder, ``reason`` which limit. train.py makes it one line
    (stopping.disk_full_message)."""

    def __init__(self, run_dir: str, path: str, reason: str = DISK_FULL):
        super().__init__(path)
        self.run_dir, self.path, self.reason = run_dir, path, reason
        self.kept = None        # what was written before it (the end of a run: its adapter)


def no_space(e: BaseException | None, path: str | None = None) -> str | None:
    """Which limit stopped a write, if one did (DISK_FULL, QUOTA or FILE_SIZE_LIMIT), else None.
    From the exception's chain: an OSError's errno, or its words (safetensors reports in words).
    torch.save reports any failed write as a bare RuntimeError ('basic_ios::clear: iostream
    error', 'unexpected pos ...'), so an OSError or a RuntimeError is also judged by ``path``, the
    file or folder being written, looked at before anything is removed: its file system (almost)
    out of space or inodes (a write that ran out used up what was left), or a file there as large
    as this process may write (RLIMIT_FSIZE: `ulimit -f`)."""
    raised, seen = e, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code, words = getattr(e, "errno", None), str(e)
        if code == errno.ENOSPC or "No space left on device" in words:
            return DISK_FULL
        if code == errno.EDQUOT or "Disk quota exceeded" in words:
            return QUOTA
        if code == errno.EFBIG or "File too large" in words:
            return FILE_SIZE_LIMIT
        e = e.__cause__ or e.__context__
    if path is None or not isinstance(raised, (OSError, RuntimeError)):
        return None
    try:
        if nearly_full(path):
            return DISK_FULL
        if at_file_size_limit(path):
            return FILE_SIZE_LIMIT
    except OSError:                     # the folder gone, say: no judgement, the error as it was
        pass
    return None


def nearest_existing(path: str) -> str:
    """path, or the nearest folder above it that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def nearly_full(path: str) -> bool:
    """Whether the file system that holds path has no inode left, or (almost) no space: under
    16 MiB and under 5% of its size. A write that ran out of space used up what was left (the
    margin: what a file system may keep back when it refuses a write)."""
    if not hasattr(os, "statvfs"):     # Windows
        return False
    disk = os.statvfs(nearest_existing(path))
    if disk.f_files and disk.f_favail == 0:
        return True
    free = disk.f_bavail * disk.f_frsize
    return free < min(16 << 20, disk.f_blocks * disk.f_frsize / 20)


def file_size_limit() -> int | None:
    """The most bytes a file of this process may hold (RLIMIT_FSIZE, `ulimit -f`), or None."""
    try:
        import resource
    except ImportError:                 # Windows
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def at_file_size_limit(path: str) -> bool:
    """Whether a file at path (or in the folder path) has reached file_size_limit()."""
    limit = file_size_limit()
    if limit is None or not os.path.exists(path):
        return False
    files = ([path] if os.path.isfile(path) else
             [os.path.join(d, f) for d, _, names in os.walk(path) for f in names])
    return any(os.path.getsize(f) >= limit for f in files)


def limit_in_words(reason: str, folder: str) -> tuple[str, str]:
    """(where the limit is, what lifts it) for a write that ``reason`` stopped in ``folder``:
    ('no space left on the disk mounted at /data, which holds /data/run', 'free space')."""
    mount = os.path.realpath(nearest_existing(folder))
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    if reason == FILE_SIZE_LIMIT:
        if (limit := file_size_limit()) is not None:
            return f"this process may write no file over {limit} bytes", "raise it (ulimit -f)"
        return f"the disk mounted at {mount} takes no larger file", "use another disk"
    left = "quota" if reason == QUOTA else "space"
    return f"no {left} left on the disk mounted at {mount}, which holds {folder}", "free space"


@contextlib.contextmanager
def full_disk_as_one_line(run_dir: str, path, cleanup: str | None = None):
    """Within this block a write stopped by a full disk, a quota or the file size limit (no_space)
    raises DiskFull(run_dir, path) (path: a string, or a function that gives the file being
    written when it failed), after removing ``cleanup`` (a half-written folder); other errors pass
    unchanged."""
    try:
        yield
    except Exception as e:
        file = path() if callable(path) else path
        reason = no_space(e, file)
        if not reason:
            raise
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise DiskFull(run_dir, file, reason) from None
