import json
import os
import subprocess
import sys

import pytest

from infra import curves
import plot
import readout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_row(step, **over):
    """A step line of metrics.jsonl, every field train.py writes; values vary with the step."""
    row = {"step": step, "round": step, "gen_tokens": 900 * step, "gen_seconds": 0.1 * step,
           "train_seconds": 0.2 * step, "skipped_steps": 0, "reward_errors": 0, "loss": -0.01,
           "reward": 0.1 + 0.01 * step, "entropy": 0.6 - 0.005 * step, "rollout_entropy": 0.61 - 0.005 * step,
           "is_ratio_mean": 1.0, "is_ratio_max": 1.5 + 0.1 * (step % 3), "is_truncated_frac": 0.01,
           "approx_kl": 0.002, "age_mean": 0.5, "age_max": 1, "uses_mean": 1.5, "zero_adv_frac": 0.3,
           "completion_len": 3.5, "grad_norm": 0.1}
    return {**row, **over}


def eval_row(step, acc, **over):
    return {"step": step, "round": step, "gen_tokens": 900 * step, "gen_seconds": 0.1 * step,
            "train_seconds": 0.2 * step, "eval_accuracy": acc, **over}


def write_run(folder, rows, config=None, tail=""):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + tail)
    if config is not None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
    return str(folder)


def healthy_run(folder, n=60, acc0=0.25, **config):
    rows = [eval_row(0, acc0)]
    for s in range(1, n + 1):
        rows.append(step_row(s))
        if s % 20 == 0:
            rows.append(eval_row(s, acc0 + 0.005 * s))
    cfg = {"prompts_per_round": 16, "num_generations": 8, "buffer_size": 256, "batch_size": 256,
           "updates_per_round": 1, "loss": "tis", "is_cap": 2.0, "lr": 1e-3, "model": "tiny", "task": "addition",
           **config}
    return write_run(folder, rows, cfg), rows


def axes_titled(fig, words):
    found = [ax for ax in fig.axes if words in ax.get_title()]
    assert len(found) == 1, [ax.get_title() for ax in fig.axes]
    return found[0]


def line(ax, gid):
    found = [ln for ln in ax.get_lines() if ln.get_gid() == gid]
    assert len(found) == 1, [ln.get_gid() for ln in ax.get_lines()]
    return found[0]


def test_running_mean_by_hand():
    assert curves.running_mean([0, 3, 6, 9], 3) == [1.5, 3, 6, 7.5]
    assert curves.running_mean([1, 5], 1) == [1, 5]


def test_read_metrics_splits_steps_from_evals_and_skips_a_cut_last_line(tmp_path):
    rows = [eval_row(0, 0.2), step_row(1), step_row(2), eval_row(2, 0.3)]
    run = write_run(tmp_path / "run", rows, tail='{"step": 3, "round": 3, "gen_to')   # killed mid-write
    steps, evals = curves.read_metrics(run)
    assert [r["step"] for r in steps] == [1, 2] and [r["eval_accuracy"] for r in evals] == [0.2, 0.3]
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:        # a broken line in the middle is an error
        f.write(json.dumps(rows[0]) + "\n{\"step\": 1,\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        curves.read_metrics(run)


def test_plot_run_draws_each_signal_with_its_healthy_range(tmp_path):
    run, rows = healthy_run(tmp_path / "run")
    fig = curves.plot_run(run)
    assert os.path.getsize(os.path.join(run, "curves.png")) > 30_000
    steps = [r for r in rows if "eval_accuracy" not in r]
    evals = [r for r in rows if "eval_accuracy" in r]

    acc = axes_titled(fig, "accuracy and reward")
    assert list(line(acc, "eval_accuracy").get_xdata()) == [r["gen_tokens"] for r in evals]
    assert list(line(acc, "eval_accuracy").get_ydata()) == [r["eval_accuracy"] for r in evals]
    # 60 steps: the raw reward drawn faintly, its running mean over 3 steps bold
    raw, mean = line(acc, "reward"), line(acc, "reward:mean")
    assert list(raw.get_ydata()) == [r["reward"] for r in steps] and raw.get_alpha() < 0.5
    assert mean.get_ydata()[10] == pytest.approx(sum(r["reward"] for r in steps[9:12]) / 3)
    timed = axes_titled(fig, "accuracy against time")
    assert list(line(timed, "eval_accuracy").get_xdata()) == pytest.approx(
        [r["gen_seconds"] + r["train_seconds"] for r in evals])

    ratio = axes_titled(fig, "importance ratio")
    assert ratio.get_yscale() == "log" and "healthy: mean ~1" in ratio.get_title()
    refs = {ln.get_label(): ln.get_ydata()[0] for ln in ratio.get_lines() if ln.get_gid() is None}
    assert refs["healthy mean: 1 (fresh data)"] == 1 and refs["cap C = 2: weights cut above"] == 2
    assert list(line(ratio, "is_ratio_max").get_ydata()) == [r["is_ratio_max"] for r in steps]

    stale = axes_titled(fig, "truncation and KL")
    band = next(p for p in stale.patches if p.get_label() == "healthy: < 0.05")
    assert band.get_y() + band.get_height() == pytest.approx(0.05)
    assert {ln.get_gid() for ln in stale.get_lines()} >= {"is_truncated_frac", "approx_kl"}

    age = axes_titled(fig, "rollout age and uses")      # expected for R = 128, N = B = 256: age 0.5, uses 1.5
    assert {ln.get_label() for ln in age.get_lines()} >= {"expected mean age 0.5", "expected mean uses 1.5"}
    assert axes_titled(fig, "policy entropy") and axes_titled(fig, "zero-advantage groups (healthy: below 1)")
    summary = fig.axes[-1].texts[0].get_text()
    assert "R = 128 new rollouts per round" in summary and "0.250 (step 0) -> 0.550 (step 60)" in summary


def test_plot_run_copes_with_a_run_that_has_only_begun(tmp_path):
    # only the step-0 eval: the accuracy point, every step panel saying why it is empty
    run = write_run(tmp_path / "fresh", [eval_row(0, 0.25)])
    fig = curves.plot_run(run, str(tmp_path / "fresh.png"))
    assert os.path.getsize(tmp_path / "fresh.png") > 10_000
    assert list(line(axes_titled(fig, "accuracy and reward"), "eval_accuracy").get_ydata()) == [0.25]
    assert axes_titled(fig, "importance ratio").texts[0].get_text() == "no optimizer step logged yet"
    # one step without the importance-ratio and age fields (older runs), no config.json
    one = step_row(1)
    for key in ("is_ratio_mean", "is_ratio_max", "age_mean", "age_max", "uses_mean"):
        del one[key]
    run = write_run(tmp_path / "one", [eval_row(0, 0.25), one, eval_row(1, 0.26, eval_strict=0.2)])
    fig = curves.plot_run(run)
    assert os.path.isfile(os.path.join(run, "curves.png"))
    assert axes_titled(fig, "importance ratio").texts[0].get_text() == "not logged in this run"
    assert list(line(axes_titled(fig, "policy entropy"), "entropy").get_ydata()) == [one["entropy"]]
    assert list(line(axes_titled(fig, "accuracy and reward"), "eval_strict").get_ydata()) == [0.2]


def test_plot_runs_overlays_one_line_per_run_named_by_its_folder(tmp_path):
    a, rows_a = healthy_run(tmp_path / "on_policy" / "seed0", acc0=0.2)
    b, rows_b = healthy_run(tmp_path / "replay" / "seed0", n=40, acc0=0.3)
    out = tmp_path / "overlay.png"
    fig = plot.plot_runs([a, b], str(out))
    assert out.stat().st_size > 20_000
    acc = axes_titled(fig, "against generated tokens")
    lines = {ln.get_label(): ln for ln in acc.get_lines()}
    assert set(lines) == {"on_policy/seed0", "replay/seed0"}
    for label, rows in (("on_policy/seed0", rows_a), ("replay/seed0", rows_b)):
        evals = [r for r in rows if "eval_accuracy" in r]
        assert list(lines[label].get_xdata()) == [r["gen_tokens"] for r in evals]
        assert list(lines[label].get_ydata()) == [r["eval_accuracy"] for r in evals]
    assert lines["on_policy/seed0"].get_color() != lines["replay/seed0"].get_color()      # one colour per run
    assert len(axes_titled(fig, "against time").get_lines()) == 2
    assert plot.run_names(["x/runs/a", "y/runs/b"]) == ["a", "b"]


def test_plot_arms_draws_compare_curves_and_the_projected_time(tmp_path, capsys):
    curve = {"tokens": [0, 100, 200], "seconds": [0, 1.0, 2.0], "projected": {"plain": [0, 3.0, 6.0]},
             "accuracy": [0.2, 0.3, 0.4], "min": [0.2, 0.25, 0.35], "max": [0.2, 0.35, 0.45]}
    replay = {**curve, "projected": {"plain": [0, 2.5, 5.5]}, "accuracy": [0.2, 0.35, 0.38]}
    summary = {"arms": {"on_policy": {"curve": curve}, "replay": {"curve": replay}}, "target_accuracy": 0.39,
               "cost": {"file": "cost.json", "curves": ["plain"]}}
    fig = plot.plot_arms(summary, str(tmp_path / "arms.png"))
    assert (tmp_path / "arms.png").stat().st_size > 10_000
    projected = axes_titled(fig, "PROJECTED time (plain curve)")
    assert list(line(projected, "replay").get_xdata()) == [0, 2.5, 5.5]
    assert [ln.get_ydata()[0] for ln in projected.get_lines() if ln.get_gid() is None] == [0.39]   # the target
    readout.plot(summary, str(tmp_path / "curves.png"))                  # compare.py draws with plot.py
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and "curves:" in capsys.readouterr().out
    del summary["cost"]                 # no cost curve: no projection, tokens and measured time only
    assert len(plot.plot_arms(summary, str(tmp_path / "two.png")).axes) == 2


def test_cli_writes_the_run_figure_or_the_overlay_and_refuses_a_folder_that_is_not_a_run(tmp_path, capsys,
                                                                                           monkeypatch):
    a, _ = healthy_run(tmp_path / "a", n=3)
    b, _ = healthy_run(tmp_path / "b", n=3)
    assert plot.main([a]) == 0 and os.path.isfile(os.path.join(a, "curves.png"))
    monkeypatch.chdir(tmp_path)
    assert plot.main([a, b]) == 0 and (tmp_path / "overlay.png").stat().st_size > 10_000
    assert capsys.readouterr().out.split() == [os.path.join(a, "curves.png"), "overlay.png"]
    os.makedirs(tmp_path / "empty")
    for folder, why in ((tmp_path / "missing", "no such folder"), (tmp_path / "empty", "has no metrics.jsonl")):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "comparison", "plot.py"), a, str(folder)],
                           capture_output=True, text=True)
        assert p.returncode == 2 and why in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_missing_matplotlib_prints_the_hint_and_writes_nothing(tmp_path, monkeypatch, capsys):
    run, _ = healthy_run(tmp_path / "run", n=3)
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # import matplotlib -> ImportError
    summary = {"arms": {}, "target_accuracy": 0.5}
    assert curves.plot_run(run) is None
    assert plot.plot_runs([run, run], str(tmp_path / "o.png")) is None
    assert plot.plot_arms(summary, str(tmp_path / "a.png")) is None
    assert plot.main([run]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 4 and all("pip install matplotlib" in line for line in out)
    assert not [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".png")]
