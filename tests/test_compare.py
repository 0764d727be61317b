import json
import sys

import pytest

import compare


def test_break_even_mu_by_hand():
    # replay generates 600 instead of 1000 rollouts but trains 2000 instead of 1000:
    # mu * 600 + 2000 < mu * 1000 + 1000  <=>  mu > 2.5
    assert compare.break_even_mu(1000, 1000, 600, 2000) == pytest.approx(2.5)
    assert compare.break_even_mu(1000, 1000, 600, 800) == 0.0        # cheaper in both: pays at any mu
    assert compare.break_even_mu(1000, 1000, 1200, 900) is None      # generates more: mu cannot help


def test_first_reach_needs_the_target_held_not_one_lucky_eval():
    xs = [10, 20, 30, 40, 50]
    assert compare.first_reach(xs, [0.1, 0.5, 0.05, 0.3, 0.3], 0.3) == 40     # 20: mean(0.5, 0.05, 0.3) < 0.3
    assert compare.first_reach(xs, [0.1, 0.3, 0.3, 0.3, 0.2], 0.3) == 20
    assert compare.first_reach(xs, [0.1, 0.1, 0.1, 0.1, 0.3], 0.3) == 50      # the last point alone at the end
    assert compare.first_reach(xs, [0.1, 0.2, 0.2, 0.2, 0.2], 0.3) is None


def test_arms_follow_their_definitions():
    def parse(flags):
        return {flags[i]: flags[i + 1] for i in range(0, 6, 2)}
    on, rep, ctl = (parse(compare.arm_flags(a, 256, 2, 8, 0.3)) for a in ("on_policy", "replay", "control"))
    # on-policy: R = B = N; replay: R = B/y, N = B (each rollout used y times); control: R = B = N = B/y
    assert (int(on["--prompts-per-round"]) * 8, int(on["--buffer-size"]), int(on["--batch-size"])) == (256, 256, 256)
    assert (int(rep["--prompts-per-round"]) * 8, int(rep["--buffer-size"]), int(rep["--batch-size"])) == (128, 256, 256)
    assert (int(ctl["--prompts-per-round"]) * 8, int(ctl["--buffer-size"]), int(ctl["--batch-size"])) == (128, 128, 128)
    assert compare.arm_flags("replay_pbr", 256, 2, 8, 0.3)[-2:] == ["--keep-correct-frac", "0.3"]


def test_quick_comparison_writes_the_summary_and_the_plot(tmp_path, tiny_path):
    summary = compare.main(["--quick", "--output-dir", str(tmp_path)])
    on_disk = json.load(open(tmp_path / "summary.json"))
    assert on_disk["target_accuracy"] == summary["target_accuracy"]
    assert set(on_disk["arms"]) == {"on_policy", "replay", "control"}
    finals = []
    for name, arm in on_disk["arms"].items():
        assert isinstance(arm["final_accuracy"], float) and 0 <= arm["final_accuracy"] <= 1
        assert arm["seeds"] == 2 and isinstance(arm["entropy"], float) and arm["entropy"] > 0
        for key in ("tokens_to_target", "seconds_to_target"):
            assert arm[key] is None or arm[key] > 0
        for seed in range(2):
            rows = [json.loads(l) for l in open(tmp_path / name / f"seed{seed}" / "metrics.jsonl")]
            assert rows[-1]["gen_tokens"] >= 30_000                   # the same token budget for every run
            if name == "on_policy":
                finals.append(rows[-1]["eval_accuracy"])
    assert on_disk["target_accuracy"] == pytest.approx(sum(finals) / 2)   # median of 2 = their mean
    assert on_disk["arms"]["on_policy"]["tokens_to_target"] is not None
    for key in ("token_ratio", "time_ratio"):
        assert on_disk[key] is None or on_disk[key] > 0
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_missing_matplotlib_is_a_message_not_a_crash(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # import matplotlib -> ImportError
    compare.plot({"arms": {}, "target_accuracy": 0.5}, str(tmp_path / "curves.png"))
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "curves.png").exists()
