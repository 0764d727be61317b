"""Issue 69, nothing lost, round five: a resume deletes nothing unasked, the last save keeps what
fits, the start-up size check measures the file it guards. Each with a real fault: a real run's
checkpoints, a real RLIMIT_FSIZE, a real tmpfs that fills up."""
import contextlib
import json
import os
import resource
import subprocess
import sys

import pytest
import torch

import train
from infra import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts-per-round", "4", "--num-generations", "4", "--batch-size", "16",
         "--buffer-size", "16", "--eval-prompts", "10", "--eval-every", "1", "--no-progress",
         "--no-plot"]


@contextlib.contextmanager
def tmpfs_of_1mb(path):
    """A real 1 MB tmpfs mounted at ``path`` (made if missing) for the block, unmounted after; the
    test skipped where none can be mounted."""
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and a system that allows it)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def rows(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def test_a_resume_from_an_older_checkpoint_deletes_nothing_unasked(tmp_path, tiny_path, capsys):
    """Item 1: --resume RUN/checkpoint-2 deleted checkpoint-3 and -4 and the metrics rows after
    round 2 as soon as the model loaded. Now it refuses in one line, before any model, naming the
    later checkpoints and the command that moves them aside; moved aside, the resume copies the
    later metrics rows to metrics-after-round-2.jsonl before it cuts them, and says so."""
    run = str(tmp_path / "run")
    train.main(SMALL + ["--max-rounds", "4", "--save-every", "1", "--keep-checkpoints", "3",
                        "--output-dir", run])
    before = sorted(os.listdir(run))
    full = rows(run)
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", os.path.join(run, "checkpoint-2")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "the run went on past it (checkpoint-3, checkpoint-4)" in err
    assert f"mv {run}/checkpoint-3 {run}/checkpoint-4 {run}/after-round-2/" in err
    assert sorted(os.listdir(run)) == before and rows(run) == full       # nothing touched
    os.mkdir(os.path.join(run, "after-round-2"))
    for r in (3, 4):
        os.rename(os.path.join(run, f"checkpoint-{r}"), os.path.join(run, "after-round-2",
                                                                     f"checkpoint-{r}"))
    capsys.readouterr()
    train.main(["--resume", os.path.join(run, "checkpoint-2"), "--max-rounds", "3"])
    assert "rows after round 2 (to round 4) are copied to" in capsys.readouterr().err
    kept = [json.loads(line) for line in open(os.path.join(run, "metrics-after-round-2.jsonl"))]
    assert kept == [r for r in full if r["round"] > 2]
    assert [r["round"] for r in rows(run)][-1] == 3


def test_the_start_up_check_measures_the_optimizer_file_it_guards(tmp_path, tiny_path):
    """Item 3: the check estimated the optimizer file at 8 bytes a weight (753,664 for the demo)
    where torch.save writes 777,051. optimizer_file_size measures it: equal to the file a run
    writes, to the byte."""
    run = str(tmp_path / "run")
    train.main(SMALL + ["--max-rounds", "1", "--output-dir", run])
    from infra.policy import load_policy
    model, _ = load_policy(tiny_path, lora_r=16)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                                  betas=(0.9, 0.99), weight_decay=0.0)
    written = os.path.getsize(os.path.join(run, "checkpoint-1", "optimizer.pt"))
    assert checkpoint.optimizer_file_size(optimizer) == written
    assert written > 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE as on Linux")
def test_a_file_size_limit_between_the_old_estimate_and_the_file_is_refused_at_once(tmp_path,
                                                                                   tiny_path):
    """Item 3, the fault itself: ulimit -f at 770,000 bytes (above the old estimate, below the
    file): the run trained, then its only save failed and the run was lost. Now it is refused
    before the first round, in one line."""
    run = tmp_path / "run"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (770_000, 770_000))    # noqa: E731
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *SMALL,
                           "--max-rounds", "2", "--output-dir", str(run)], capture_output=True,
                          text=True, timeout=300, preexec_fn=limit,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = [line for line in done.stderr.strip().splitlines() if "publisher trust" not in line]
    assert done.returncode == 1 and len(err) == 1, done.stderr
    assert "may write no file over 770000 bytes" in err[0]
    assert "optimizer state takes more than 770,000 (measured)" in err[0]
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_full_disk_at_the_last_save_keeps_the_adapter_and_says_so(tmp_path, tiny_path):
    """Item 2: a disk that filled up at the end-of-run save (the default --save-every 0) lost the
    whole run, though the adapter alone would have fit. On a real 1 MB tmpfs: the adapter (388
    kB) is written first and kept whole, the checkpoint (the optimizer alone 777 kB) is not, and
    the one line says both; the adapter loads."""
    with tmpfs_of_1mb(tmp_path / "disk") as disk:
        run = str(disk / "run")
        done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *SMALL,
                               "--max-rounds", "2", "--output-dir", run], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 1, done.stderr
        assert last.startswith("error: the disk is full: ") and "could not be written" in last, last
        assert f"the trained adapter was saved to {run}/adapter" in last, last
        from safetensors.torch import load_file
        weights = load_file(os.path.join(run, "adapter", "adapter_model.safetensors"))
        assert weights and all(torch.isfinite(t).all() for t in weights.values())
        del weights                     # its file is mapped: the disk could not be unmounted
        assert not any(name.startswith(("checkpoint-", ".tmp-")) for name in os.listdir(run))


@pytest.mark.slow
def test_an_old_checkpoint_that_cannot_be_removed_is_said(tmp_path, tiny_path, capsys):
    """Item 15: with too few file descriptors the run reported success, its old checkpoints not
    pruned and nothing said. A real fault: a tmpfs mounted inside checkpoint-1 (the folder cannot
    be removed: busy). Saving checkpoint-2 with --keep-checkpoints 1 keeps checkpoint-2 whole and
    says, in one line, what it could not remove."""
    run = str(tmp_path / "run")
    train.main(SMALL + ["--max-rounds", "1", "--save-every", "1", "--keep-checkpoints", "1",
                        "--output-dir", run])
    with tmpfs_of_1mb(os.path.join(run, "checkpoint-1", "busy")):
        capsys.readouterr()
        train.main(["--resume", run, "--max-rounds", "2"])
        err = [line for line in capsys.readouterr().err.splitlines() if "could not remove" in line]
        assert len(err) == 1 and f"saved {run}/checkpoint-2, but could not remove" in err[0]
        assert f"{run}/checkpoint-1 (" in err[0] and "remove them by hand" in err[0]
        checkpoint.read(os.path.join(run, "checkpoint-2"))              # whole


@pytest.mark.slow
def test_the_full_disk_line_is_not_printed_on_the_progress_bar(tmp_path, tiny_path):
    """Item 14: with the progress bar on a terminal, the full-disk line printed on the bar's line
    (after its \\r) and the bar was drawn again below it. On a real 1 MB tmpfs, stderr a real pty:
    the line starts a line of its own, and nothing of the bar follows it."""
    import fcntl
    import pty
    import struct
    import termios
    with tmpfs_of_1mb(tmp_path / "disk") as disk:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # 100 columns
        try:
            with_bar = [a for a in SMALL if a != "--no-progress"]
            proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *with_bar,
                                     "--max-rounds", "2", "--output-dir", str(disk / "run")],
                                    stdout=subprocess.DEVNULL,
                                    stderr=slave, env={**os.environ, "OMP_NUM_THREADS": "1"})
            os.close(slave)
            out = b""
            while True:
                try:
                    chunk = os.read(master, 4096)
                except OSError:             # the child closed the pty
                    break
                if not chunk:
                    break
                out += chunk
            assert proc.wait(timeout=300) == 1
            text = out.decode(errors="replace")
            at = text.index("error: the disk is full")
            assert "rounds:" in text[:at], repr(text)              # the bar was drawn
            assert text[at - 1] == "\n", repr(text[max(0, at - 80):at + 20])
            assert "rounds:" not in text[at:], repr(text[at:])
        finally:
            os.close(master)
