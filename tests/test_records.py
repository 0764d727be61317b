"""Every committed summary in docs/results/ is what its records give: the comparison rebuilt from
the summary's own arguments reads each run from docs/results/records/ (nothing runs, nothing is
built) and must give the committed figures; every record is read by some summary, under the name
its own flags give it, so that no rerun can have overwritten what a summary was computed from."""
import argparse
import glob
import hashlib
import json
import os

import pytest

import compare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
SUMMARIES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, "*.json"))
                   if json.load(open(p)).get("args", {}).get("records"))
# compare.py's flags added after some summaries were written, at the values that give the code
# before them (a summary without the flag was computed with it off)
BEFORE_FLAG = {"early_tokens": 0, "early_evals": None, "gen_shares": [],
               "skip_zero_advantage": False, "prompts_per_round": 4,
               "target": None, "target_rule": "hold", "arm": [], "pairs": []}
# What a summary stores that is not a figure of its records: the verdict, plain words for the
# intervals checked here, worded anew since the first summaries (test_compare checks each stored
# verdict against its own intervals); the name of the sweep's rule before the hold rule.
NOT_FIGURES = {"verdict", "score"}


def stored_args(summary: dict, output_dir) -> argparse.Namespace:
    return argparse.Namespace(**{**BEFORE_FLAG, **summary["args"], "output_dir": str(output_dir)})


def by_area(choose_lr):
    """choose_lr by the sweep's rule before the hold rule (874220b): the largest mean accuracy over
    the evals, which choose_lr still gives as area_choice. tuned.json and columns_b64_tuned.json
    were chosen by it; the hold rule picks another lr for one arm of each (tuned_hold.json and
    columns_b64_tuned_hold.json are the same comparisons under it)."""
    def choose(runs_by_lr, target):
        c = choose_lr(runs_by_lr, target)
        lrs = sorted(runs_by_lr)
        return {**c, "chosen": c["area_choice"], "rules_agree": True,
                "on_grid_edge": len(lrs) > 1 and c["area_choice"] in (lrs[0], lrs[-1])}
    return choose


def run_nothing(monkeypatch, summary: dict, read: list | None = None) -> None:
    """compare.py patched to read records only: a run or a model build fails the test; read, if
    given, collects the path of every record read."""
    monkeypatch.chdir(ROOT)             # the summaries' --records and --cost: from the root

    def refuse(*a, **k):
        raise AssertionError(f"a run that has no record would run: {a[0]}")
    monkeypatch.setattr(compare, "run_train", refuse)
    monkeypatch.setattr(compare, "build_tiny_model", refuse)
    monkeypatch.setattr(compare, "plot", lambda s, path: None)
    if (summary.get("lr_sweep") or {}).get("score") == "mean accuracy over the evals":
        monkeypatch.setattr(compare, "choose_lr", by_area(compare.choose_lr))
    load = compare.load_record

    def load_record(path, argv, model, threads=1):
        record = load(path, argv, model, threads)
        assert record is not None, f"no record of the run {path}"
        if read is not None:
            read.append(os.path.relpath(path, ROOT))
        return record
    monkeypatch.setattr(compare, "load_record", load_record)


def differences(committed, recomputed, where="") -> list[str]:
    """Where recomputed differs from what committed stores (recomputed may hold more)."""
    if isinstance(committed, dict) and isinstance(recomputed, dict):
        return [line for k, v in committed.items() if k not in NOT_FIGURES
                for line in (differences(v, recomputed[k], f"{where}/{k}") if k in recomputed
                             else [f"{where}/{k}: not recomputed"])]
    if (isinstance(committed, list) and isinstance(recomputed, list)
            and len(committed) == len(recomputed)):
        return [line for i, (a, b) in enumerate(zip(committed, recomputed))
                for line in differences(a, b, f"{where}[{i}]")]
    close = (isinstance(committed, float) and isinstance(recomputed, float)
             and abs(committed - recomputed) <= 1e-9 * max(1.0, abs(committed)))
    return [] if committed == recomputed or close else [
        f"{where}: committed {committed!r}, recomputed {recomputed!r}"]


@pytest.mark.parametrize("name", SUMMARIES)
def test_a_committed_summary_is_what_its_records_give(name, tmp_path, monkeypatch):
    summary = json.load(open(os.path.join(RESULTS, name)))
    run_nothing(monkeypatch, summary)
    recomputed = json.loads(json.dumps(compare.compare(stored_args(summary, tmp_path))))  # as saved
    committed = {k: v for k, v in summary.items() if k != "args"}     # args: what was given
    assert differences(committed, recomputed) == []


def test_every_record_is_read_by_a_summary_under_its_own_key(tmp_path, monkeypatch):
    """Each record's name carries the key of its own flags and starting model (records.record_path),
    so a run with other flags lands beside it, not over it; each run of a summary reads a record of
    its own; and some summary reads each record. The figures are the test above's."""
    assert len(SUMMARIES) >= 9
    read = []
    for i, name in enumerate(SUMMARIES):
        summary = json.load(open(os.path.join(RESULTS, name)))
        runs = []
        with monkeypatch.context() as m:
            run_nothing(m, summary, runs)
            m.setattr(compare, "summarize", lambda *a, **k: {})
            m.setattr(compare, "print_table", lambda s: None)
            compare.compare(stored_args(summary, tmp_path / str(i)))
        assert len(set(runs)) == len(runs), f"{name}: two runs read one record"
        read += runs
    pattern = os.path.join(RESULTS, "records", "**", "*.json")
    files = sorted(os.path.relpath(p, ROOT) for p in glob.glob(pattern, recursive=True))
    for path in files:
        record = json.load(open(os.path.join(ROOT, path)))
        flags = json.dumps([record["argv"], record["model"]])
        key = hashlib.sha256(flags.encode()).hexdigest()[:10]         # as records.record_path
        assert path.endswith(f"-{key}.json"), f"{path}: its flags give the key {key}"
    # a comparison still running has its finished runs' records in a folder with a PENDING.md that
    # gives its command; no summary need read them yet (a summary may read others of that folder)
    pending = {os.path.dirname(os.path.relpath(p, ROOT))
               for p in glob.glob(os.path.join(RESULTS, "records", "*", "PENDING.md"))}
    for folder in pending:
        assert "python comparison/compare.py" in open(os.path.join(ROOT, folder, "PENDING.md")).read()
    assert set(read) <= set(files)
    assert sorted(set(read) | {f for f in files if f.startswith(tuple(d + os.sep for d in pending))}) == files


def test_every_run_s_rows_beside_its_record_read_back_to_that_record():
    """Records written since issue 52 keep every metrics row of their run beside them, gzipped
    (records.save_rows), so that empty rounds, discards and ages can be counted afterwards: each
    such file belongs to a record, and the record made again from its rows is that record; a record
    that counts its rounds has its rows."""
    import records
    pattern = os.path.join(RESULTS, "records", "**", "*.json")
    for path in glob.glob(pattern, recursive=True):
        record = json.load(open(path))
        has_rows = os.path.exists(records.rows_path(path))
        assert has_rows or "rounds" not in record, f"{path}: counts its rounds but has no rows"
        if has_rows:
            again = records.record_of(records.read_rows(path), record["config"], path)
            assert {**record, **again} == record and again.keys() <= record.keys(), path
    kept = os.path.join(RESULTS, "records", "**", "*.metrics.jsonl.gz")
    for rows in glob.glob(kept, recursive=True):
        assert os.path.exists(rows[:-len(".metrics.jsonl.gz")] + ".json"), f"{rows}: no record"
