"""--report-to wandb, offline: the W&B run holds every line of metrics.jsonl once, across resumes.

The offline run files (run-<id>.wandb) are read back with a small reader of their record format
(LevelDB-style log blocks of wandb's own protobuf Records), as `wandb sync` would send them.
"""
import glob
import json
import os

import pytest

import train

SMALL = ["--prompts-per-round", "4", "--num-generations", "4", "--buffer-size", "16", "--batch-size", "16",
         "--eval-prompts", "20", "--eval-every", "2", "--save-every", "2", "--no-plot", "--no-progress"]
TIMES = {"gen_seconds", "train_seconds"}        # wall-clock: a re-run round takes another time


def wandb_records(path):
    """The protobuf Records of an offline .wandb file: a 7-byte header (':W&B', magic, version),
    then 32 KiB blocks of chunks, each [crc32 (4) | length (2, little-endian) | type (1)] + data;
    type 1 is a whole record, 2/3/4 its first/middle/last part."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:                  # a block's tail too short for a chunk header
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_offline_runs(wandb_dir):
    """[(run id, config dict, [(W&B step, row)], {metric: its x-axis})] of each offline run
    segment, oldest first."""
    segments = []
    # by when each was last written: the folders' names hold the start to the second, and two runs of
    # one test often start within one (the name then orders them by their random ids)
    paths = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    for path in sorted(paths, key=lambda p: os.stat(p).st_mtime_ns):
        run_id, config, rows, axes = None, {}, [], {}
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
            elif kind == "metric":
                axes[r.metric.name or r.metric.glob_name] = r.metric.step_metric
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                rows.append((r.history.step.num, {k: v for k, v in row.items() if not k.startswith("_")}))
        segments.append((run_id, config, rows, axes))
    return segments


def later_aside(run, round: int) -> None:
    """The checkpoints after ``round`` moved aside, as a resume from checkpoint-<round> asks."""
    aside = run / f"after-round-{round}"
    aside.mkdir()
    for name in os.listdir(run):
        if name.startswith("checkpoint-") and int(name.split("-")[1]) > round:
            os.rename(run / name, aside / name)


def test_wandb_offline_holds_each_line_once_across_resumes(tmp_path, tiny_path, monkeypatch, optional):
    """Three segments: rounds 1-2 without W&B; --resume with --report-to wandb to round 4 (the W&B
    run gets the earlier lines from metrics.jsonl); --resume from checkpoint-2 to round 6, so rounds
    3-4 run again (W&B already holds them: not sent twice) and 5-6 are new. The W&B run is one id,
    and its history is metrics.jsonl's final timeline, each line once, at the line's number."""
    optional("wandb", "--report-to wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    os.makedirs(tmp_path / "wandb-dir")
    run = tmp_path / "run"
    train.main(SMALL + ["--output-dir", str(run), "--max-rounds", "2"])
    train.main(["--resume", str(run), "--max-rounds", "4", "--report-to", "wandb"])
    first = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert json.load(open(run / "wandb.json"))["lines"] == len(first)
    later_aside(run, 2)
    train.main(["--resume", str(run / "checkpoint-2"), "--max-rounds", "6", "--report-to", "wandb"])
    final = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert final[-1]["round"] == 6 and len(final) > len(first)

    segments = read_offline_runs(tmp_path / "wandb-dir")
    assert len(segments) == 2 and segments[0][0] == segments[1][0]          # one W&B run, continued
    assert segments[0][1]["max_rounds"] == 4 and segments[1][1]["max_rounds"] == 6   # the config, updated
    assert segments[0][1]["lr"] == 1e-3 and segments[0][1]["report_to"] == "wandb"
    assert all(axes == {"round": "", "*": "round"} for *_, axes in segments)   # charted against the round
    logged = [entry for _, _, rows, _ in segments for entry in rows]
    assert [step for step, _ in logged] == list(range(len(final)))          # every line once, in order
    numbers = lambda line: {k: v for k, v in line.items() if not isinstance(v, list)}   # lists stay in the file
    for (_, row), line, old in zip(logged, final, first + [None] * len(final)):
        line, old = numbers(line), old and numbers(old)
        assert set(row) == set(line)                                         # the same keys
        # the re-run rounds 3-4 keep their first values in W&B; equal but for time (exact resume)
        source = old if old is not None else line
        assert {k: v for k, v in row.items() if k not in TIMES} == pytest.approx(
            {k: v for k, v in source.items() if k not in TIMES})
    # the lines of rounds 3-4 were written twice to metrics.jsonl (then cut back), sent once
    assert len(first) == len([line for line in final if line["round"] <= 4])
    assert [line["round"] for line in first[-2:]] == [4, 4] and first[-3]["round"] == 3



def test_a_resume_that_changes_the_rerun_rounds_starts_a_new_wandb_run(tmp_path, tiny_path, monkeypatch, optional):
    """W&B holds rounds 1-4; the resume from checkpoint-2 runs rounds 3-4 again at another lr: the
    W&B run's rounds 3-4 are of an abandoned timeline, so a new W&B run takes the final one, every
    line once with its new values (the old run keeps its own, untouched)."""
    optional("wandb", "--report-to wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    os.makedirs(tmp_path / "wandb-dir")
    run = tmp_path / "run"
    train.main(SMALL + ["--output-dir", str(run), "--max-rounds", "4", "--report-to", "wandb"])
    later_aside(run, 2)
    train.main(["--resume", str(run / "checkpoint-2"), "--lr", "3e-3"])
    final = [json.loads(line) for line in open(run / "metrics.jsonl")]
    segments = read_offline_runs(tmp_path / "wandb-dir")
    assert len(segments) == 2 and segments[0][0] != segments[1][0]          # a new W&B run
    assert segments[1][1]["lr"] == 3e-3
    new_rows = segments[1][2]
    assert [step for step, _ in new_rows] == list(range(len(final)))
    for (_, row), line in zip(new_rows, final):
        assert {k: v for k, v in row.items() if k not in TIMES} == pytest.approx(
            {k: v for k, v in line.items() if k not in TIMES and not isinstance(v, list)})
    assert json.load(open(run / "wandb.json"))["id"] == segments[1][0]


def test_wandb_without_a_login_is_one_line_before_any_model(tmp_path, monkeypatch, capsys, optional):
    optional("wandb", "--report-to wandb")
    from infra import cli
    from infra import loading
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))                               # no ~/.netrc
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        train.main(["--report-to", "wandb", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "wandb login" in err and "WANDB_MODE=offline" in err
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    (tmp_path / ".netrc").chmod(0o600)                                       # as `wandb login` leaves it
    assert cli.wandb_credentials()                                          # `wandb login` saved a key
