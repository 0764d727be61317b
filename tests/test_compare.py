import argparse
import json
import math
import sys
import types

import pytest

import compare
import readout
import records
import stats
import summaries
import train
from conftest import cost_file, fake_train


def test_reach_needs_the_target_held_not_one_lucky_eval():
    target = 0.464
    # a lucky last eval: the median of the last three is 0.40
    assert stats.reach_index([0.30, 0.40, 0.40, 0.40, 0.40, 0.47], target) is None
    # a lucky early eval, everything after it below
    assert stats.reach_index([0.30, 0.60, 0.40, 0.40, 0.30, 0.30], target) is None
    # held from index 3 (its neighbourhood 0.47, 0.30, 0.50 has median 0.47: the 0.30 is the outlier);
    # index 2's neighbourhood 0.40, 0.47, 0.30 has median 0.40
    assert stats.reach_index([0.30, 0.40, 0.47, 0.30, 0.50, 0.48, 0.47], target) == 3
    assert stats.reach_index([0.1, 0.2, 0.5, 0.5, 0.5, 0.5], 0.5) == 2
    # reached, then lost: not held, so not reached
    assert stats.reach_index([0.1, 0.5, 0.5, 0.5, 0.2, 0.2], 0.5) is None
    # a curve always reaches its own final accuracy (the median of its last three evals)
    for accs in ([0.1, 0.3, 0.2, 0.5, 0.4, 0.45], [0.5, 0.4, 0.3, 0.2, 0.1, 0.05], [0.2, 0.2, 0.2]):
        assert stats.reach_index(accs, stats.final_accuracy(accs)) is not None


def run_of(accs, R=100, B=100, rounds=None, tokens_per_rollout=10, entropy=0.5):
    """A constructed run: eval k after rounds[k] rounds (default k) and as many steps (K = 1), R rollouts of
    tokens_per_rollout tokens a round, 1 s a round."""
    rounds = rounds or list(range(len(accs)))
    return {"accuracy": accs, "rounds": rounds, "steps": rounds, "tokens": [r * R * tokens_per_rollout for r in rounds],
            "seconds": [float(r) for r in rounds], "R": R, "B": B, "entropy": entropy,
            "gen_seconds": 1.0, "train_seconds": 1.0, "rollouts_generated": rounds[-1] * R,
            "rollouts_trained": rounds[-1] * B}


def test_the_crossing_is_interpolated_between_the_eval_before_and_the_reach():
    xs = {"tokens": [0, 100, 200, 300, 400, 500], "seconds": [0, 2, 4, 6, 8, 10], "rounds": [0, 1, 2, 3, 4, 5],
          "steps": [0, 2, 4, 6, 8, 10]}
    # smoothed: 0.2, 0.4, 0.6, 0.6 at evals 1-4: the reach is eval 3 (0.6), the eval before has 0.4, so the
    # target 0.5 is crossed halfway between them
    point = stats.reach_point({"accuracy": [0.1, 0.2, 0.4, 0.6, 0.6, 0.6], **xs}, 0.5)
    assert point == {"tokens": 250, "seconds": 5.0, "rounds": 2.5, "steps": 5.0}
    # a quarter of the way: (0.45 - 0.4) / (0.6 - 0.4)
    assert stats.reach_point({"accuracy": [0.1, 0.2, 0.4, 0.6, 0.6, 0.6], **xs}, 0.45)["tokens"] == pytest.approx(225)
    # reached at eval 1: the eval before is eval 0, unsmoothed: (0.5 - 0.2) / (0.8 - 0.2) of the way
    short = {k: v[:4] for k, v in xs.items()}
    assert stats.reach_point({"accuracy": [0.2, 0.8, 0.8, 0.8], **short}, 0.5)["tokens"] == pytest.approx(50)
    # a curve that starts above the target: no crossing to place, the reach eval itself (as before)
    assert stats.reach_point({"accuracy": [0.9, 0.8, 0.8, 0.8], **short}, 0.5)["tokens"] == 100
    assert stats.reach_point({"accuracy": [0.1, 0.2, 0.2, 0.2], **short}, 0.5) is None


def test_figures_against_on_policy_by_hand_and_a_linear_cost_curve_is_the_mu_projection(tmp_path):
    on = [run_of([0.1, 0.2, 0.3, 0.4, 0.5, 0.5], R=100, B=100, entropy=0.6)]
    # half the rollouts a round, the same batch; smoothed 0.3 at eval 1, 0.7 at eval 2: target 0.5 crossed
    # halfway, at 1.5 rounds and steps
    rep = [run_of([0.1, 0.3, 0.7, 0.7, 0.7, 0.7], R=50, B=100, entropy=0.5)]
    a, b = 0.01, 0.002                                   # gen(R) = a R, train(B) = b B: mu = a / b = 5
    cost = stats.load_cost(cost_file(tmp_path / "c.json", lambda R: a * R, lambda B: b * B))
    units = stats.unit_costs(cost, {"on_policy": (100, 100), "replay": (50, 100)})
    fig = stats.figures({"on_policy": on, "replay": rep}, 1.0, units)
    # target: the median of on-policy's last three, 0.5, reached (with s = 0.5 exactly) at eval 4
    assert fig["target"] == pytest.approx(0.5)
    assert fig["arms"]["on_policy"]["tokens"] == 4000 and fig["arms"]["replay"]["tokens"] == pytest.approx(750)
    vs = fig["arms"]["replay"]["vs"]["on_policy"]
    assert vs["token_ratio"] == pytest.approx(750 / 4000) and vs["time_ratio"] == pytest.approx(1.5 / 4)
    # projected: rounds x gen(R) + steps x train(B); the old model's mu x generated + trained, in the same ratio
    assert fig["arms"]["replay"]["projected"]["plain"] == pytest.approx(1.5 * a * 50 + 1.5 * b * 100)
    mu = a / b
    by_mu = (mu * 1.5 * 50 + 1.5 * 100) / (mu * 4 * 100 + 4 * 100)
    assert vs["projected_ratio"]["plain"] == pytest.approx(by_mu) and by_mu == pytest.approx(525 / 2400)
    assert vs["accuracy_diff"] == pytest.approx(0.7 - 0.5) and vs["entropy_diff"] == pytest.approx(-0.1)
    never = [run_of([0.1] * 6, R=50, B=100)]
    vs = stats.figures({"on_policy": on, "replay": never}, 1.0, units)["arms"]["replay"]["vs"]["on_policy"]
    assert vs["token_ratio"] == vs["projected_ratio"]["plain"] == float("inf")


def arms_reaching_at_equal_tokens():
    """on-policy (R = B = 256), replay (R = 128, B = 256) and control (R = B = 128) reach the target at
    the same tokens, eval 3 (3000 tokens, one token a rollout): 3000 / R rounds and as many steps."""
    accs = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    tokens = [0, 1000, 2000, 3000, 4000, 5000]
    return {arm: [{**run_of(accs, R=R, B=B, tokens_per_rollout=1), "tokens": tokens, "rounds": [t / R for t in tokens],
                   "steps": [t / R for t in tokens]}]
            for arm, R, B in (("on_policy", 256, 256), ("replay", 128, 256), ("control", 128, 128))}


def test_a_flat_generation_curve_favours_big_rounds(tmp_path):
    results = arms_reaching_at_equal_tokens()
    cost = stats.load_cost(cost_file(tmp_path / "flat.json", lambda R: 1.0, lambda B: 0.001 * B))
    units = stats.unit_costs(cost, {"on_policy": (256, 256), "replay": (128, 256), "control": (128, 128)})
    arms = stats.figures(results, 1.0, units)["arms"]
    # a round costs 1 s whatever its size: on-policy's fewer, bigger rounds win
    on, rep, ctl = (3000 / 256) * (1 + 0.256), (3000 / 128) * (1 + 0.256), (3000 / 128) * (1 + 0.128)
    assert [arms[a]["projected"]["plain"] for a in ("on_policy", "replay", "control")] == [
        pytest.approx(on), pytest.approx(rep), pytest.approx(ctl)]
    assert arms["replay"]["vs"]["on_policy"]["projected_ratio"]["plain"] == pytest.approx(2.0)
    assert arms["replay"]["vs"]["control"]["projected_ratio"]["plain"] == pytest.approx(rep / ctl)
    # the same counts on a linear curve: on-policy and the control tie, replay pays for its bigger batch
    units = stats.unit_costs(stats.load_cost(cost_file(tmp_path / "lin.json", lambda R: 0.004 * R,
                                                       lambda B: 0.001 * B)),
                               {"on_policy": (256, 256), "replay": (128, 256), "control": (128, 128)})
    arms = stats.figures(results, 1.0, units)["arms"]
    assert arms["control"]["vs"]["on_policy"]["projected_ratio"]["plain"] == pytest.approx(1.0)


def test_the_cost_curve_is_interpolated_linearly_and_refused_outside_its_range(tmp_path, monkeypatch):
    points = [[16, 0.5], [32, 1.0], [64, 1.4]]
    assert stats.interpolate(points, 48, "R =") == pytest.approx(1.2)       # halfway from 1.0 to 1.4
    assert stats.interpolate(points, 16, "R =") == 0.5 and stats.interpolate(points, 64, "R =") == 1.4
    with pytest.raises(stats.CompareError, match="control: R = 8 is outside the cost curve's range 16..64"):
        stats.unit_costs({"curves": {"plain": {"generation": points, "training": points}}},
                         {"on_policy": (16, 16), "control": (8, 8)})
    # compare.py refuses it in one line before any run: B = 64 gives a control of R = B = 32 < 64
    monkeypatch.setattr(compare, "run_train", lambda *a: pytest.fail("ran"))
    monkeypatch.setattr(compare, "build_tiny_model", lambda *a: pytest.fail("built"))
    path = cost_file(tmp_path / "c.json", lambda R: 1.0, lambda B: 1.0, sizes=(64, 128))
    with pytest.raises(SystemExit):
        compare.main(["--output-dir", str(tmp_path / "o"), "--batch-size", "64", "--cost", path])
    # a point that did not fit in memory ends the curve before it
    oom = json.loads(open(path).read())
    oom["generation"]["plain"].append({"R": 256, "error": "out of memory"})
    (tmp_path / "oom.json").write_text(json.dumps(oom))
    with pytest.raises(stats.CompareError, match="R = 256 is outside the cost curve's range 64..128"):
        stats.unit_costs(stats.load_cost(str(tmp_path / "oom.json")), {"on_policy": (256, 128)})
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(stats.CompareError, match="not a cost file"):
        stats.load_cost(str(tmp_path / "bad.json"))


def test_replay_against_its_control_is_paired_per_replicate():
    """Model 0 learns fast, model 1 slowly, model 2 in between, under every arm; replay needs half its
    control's tokens on each model. Drawn in pairs, every draw says 0.5; the spread of replay's own tokens
    to the target (its interval) is wide, so a ratio of two intervals could not say it."""
    curves = ([0.1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], [0.1, 0.1, 0.1, 0.1, 0.5, 0.5, 0.5, 0.5],
              [0.1, 0.1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    results = {"on_policy": [run_of(c, R=256, B=256) for c in curves],
               "replay": [run_of(c, R=64, B=128) for c in curves],
               "control": [run_of(c, R=128, B=128) for c in curves]}
    ci = stats.bootstrap(results, n=300)
    assert ci["arms"]["replay"]["vs"]["control"]["token_ratio"] == [pytest.approx(0.5), pytest.approx(0.5)]
    assert ci["arms"]["replay"]["vs"]["on_policy"]["token_ratio"] == [pytest.approx(0.25), pytest.approx(0.25)]
    lo, hi = ci["arms"]["replay"]["tokens"]
    assert hi >= 2 * lo
    assert stats.default_pairs(["on_policy", "replay", "control", "replay_y3"]) == [
        ("replay", "on_policy"), ("control", "on_policy"), ("replay_y3", "on_policy"), ("replay", "control")]
    assert [stats.control_of(a) for a in ("replay", "replay_pbr", "replay_y4", "replay_nonzero", "replay_y3",
                                         "control", "on_policy")] == [
        "control", "control", "control_y4", "control_nonzero", None, None, None]


def test_a_larger_buffer_is_read_against_the_same_arm_with_the_smaller_one():
    """replay_big differs from replay by its buffer alone: summary.json pairs the two (claim 4 of the
    paper). Here replay first reaches 0.5 at eval 2 and replay_big at eval 4 of the same rounds: twice
    replay's tokens; one replicate of replay_big falls back to 0.3 after, replay never does."""
    on = [run_of([0.1, 0.3, 0.5, 0.5, 0.5, 0.5, 0.5], R=64, B=64)] * 3
    rep = [run_of([0.1, 0.3, 0.5, 0.5, 0.5, 0.5, 0.5], R=32, B=64)] * 3
    big = [run_of(accs, R=32, B=64) for accs in ([0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5],
                                                 [0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5],
                                                 [0.1, 0.2, 0.3, 0.4, 0.5, 0.3, 0.5])]
    results = {"on_policy": on, "replay": rep, "replay_big": big, "control": rep}
    assert ("replay_big", "replay") in stats.default_pairs(results)
    assert stats.smaller_buffer_of("replay_big") == "replay" and stats.smaller_buffer_of("replay") is None
    fig = stats.figures(results)["arms"]["replay_big"]["vs"]["replay"]
    # target 0.5; replay first reaches it at eval 2 (640 tokens), replay_big at eval 4 (1280) in each run
    assert fig["first_token_ratio"] == pytest.approx(2.0)
    # the fall after reach: 0, 0, 0.2 -> a mean of 0.2 / 3 more than replay's 0
    assert fig["instability_diff"] == pytest.approx(0.2 / 3)
    args = argparse.Namespace(task="addition", model="tiny", train_args="", target_frac=1.0, bootstrap=50,
                              one_model=True, budget_tokens=5000, jobs=2, sweep_lr=None, batch_size=64,
                              replay_ratio=2, num_generations=8, keep_correct_frac=0.3)
    summary = summaries.summarize(results, args, [0, 1, 2, 3, 4, 5, 6], {"on_policy": 1e-3})
    pair = summary["arms"]["replay_big"]["vs_smaller_buffer"]
    assert pair["arm"] == "replay" and pair["first_reach_token_ratio"] == pytest.approx(2.0)
    assert summary["arms"]["replay_big"]["vs_control"]["arm"] == "control"
    assert "vs_smaller_buffer" not in summary["arms"]["replay"]
    assert stats.verdicts_that_disagree(summary) == []


def test_bootstrap_covers_the_spread_of_seeds():
    on = [run_of([0.1, 0.2, 0.3, 0.4, 0.5, 0.5])] * 3
    noisy = [run_of([0.1, 0.1 + d, 0.5 + d, 0.5 + d, 0.5 + d, 0.5 + d], R=50) for d in (-0.2, 0.0, 0.1)]
    ci = stats.bootstrap({"on_policy": on, "replay": noisy}, n=400)
    lo, hi = ci["arms"]["replay"]["vs"]["on_policy"]["accuracy_diff"]
    assert -0.2 <= lo < 0 < hi <= 0.1 + 1e-9                 # within noise: the interval spans 0
    assert 0 < ci["arms"]["replay"]["not_reached_frac"] < 1  # resamples of the -0.2 seed alone never reach
    assert ci["arms"]["on_policy"]["not_reached_frac"] == 0  # on-policy always reaches its own target
    assert stats.verdict([0.4, 0.9], [-0.01, 0.02]) == "fewer tokens; final accuracy within noise"
    assert stats.verdict([0.8, 1.3], [0.01, 0.02]) == "tokens within noise; higher final accuracy"


def test_target_frac_puts_the_target_on_the_rise_by_hand():
    on = [run_of([0.4, 0.6, 0.8, 0.9, 0.9, 0.9], R=100)]
    rep = [run_of([0.4, 0.8, 0.9, 0.9, 0.9, 0.9], R=50)]
    assert stats.target_accuracy(on, 0.5) == pytest.approx(0.65)            # 0.4 + 0.5 * (0.9 - 0.4)
    vs = lambda frac, o=on: stats.figures({"on_policy": o, "replay": rep}, frac)["arms"]["replay"]["vs"]["on_policy"]
    # frac 0.5: on-policy crosses 0.65 between eval 1 (smoothed 0.6) and 2 (0.8), a quarter of the way:
    # 1000 + 250 tokens; replay between eval 0 (0.4) and 1 (0.8), 0.625 of the way: 312.5
    assert vs(0.5)["token_ratio"] == pytest.approx(312.5 / 1250)
    # frac 1: the target is 0.9, met exactly at evals 3 and 2
    assert vs(1.0)["token_ratio"] == pytest.approx(1000 / 3000)
    assert vs(0.5)["accuracy_diff"] == pytest.approx(0.0)
    # a falling on-policy curve (0.5 -> 0.3): the target is its final accuracy, held from eval 1, and both
    # start above it: the reach evals themselves
    falling = [run_of([0.5, 0.6, 0.4, 0.3, 0.3, 0.3], R=100)]
    assert stats.target_accuracy(falling, 0.9) == pytest.approx(0.3)
    assert vs(0.9, falling)["token_ratio"] == pytest.approx(500 / 1000)


def test_arms_follow_their_definitions():
    def parse(flags):
        return {flags[i]: flags[i + 1] for i in range(0, 6, 2)}
    on, rep, ctl = (parse(records.arm_flags(a, 256, 2, 8, 0.3)) for a in ("on_policy", "replay", "control"))
    # on-policy: R = B = N; replay: R = B/y, N = B (each rollout used y times); control: R = B = N = B/y
    assert (int(on["--prompts-per-round"]) * 8, int(on["--buffer-size"]), int(on["--batch-size"])) == (256, 256, 256)
    assert (int(rep["--prompts-per-round"]) * 8, int(rep["--buffer-size"]), int(rep["--batch-size"])) == (128, 256, 256)
    assert (int(ctl["--prompts-per-round"]) * 8, int(ctl["--buffer-size"]), int(ctl["--batch-size"])) == (128, 128, 128)
    assert records.arm_flags("replay_pbr", 256, 2, 8, 0.3)[-2:] == ["--keep-correct-frac", "0.3"]
    for arm, cap in (("replay_cap1", 1.0), ("replay_cap4", 4.0)):   # the replay arm, another cap C
        flags = records.arm_flags(arm, 256, 2, 8, 0.3)
        assert flags == records.arm_flags("replay", 256, 2, 8, 0.3) + ["--is-cap", str(cap)]
    y3 = parse(records.arm_flags("replay_y3", 240, 2, 8, 0.3))     # each rollout used 3 times: R = B/3
    assert (int(y3["--prompts-per-round"]) * 8, int(y3["--buffer-size"]), int(y3["--batch-size"])) == (80, 240, 240)
    # y = 4 whatever --replay-ratio: replay_y4 R = B/4, N = B = 4R; its control R = B = N = B/4
    assert parse(records.arm_flags("replay_y4", 256, 2, 8, 0.3)) == {
        "--prompts-per-round": "8", "--buffer-size": "256", "--batch-size": "256"}
    assert parse(records.arm_flags("control_y4", 256, 2, 8, 0.3)) == {
        "--prompts-per-round": "8", "--buffer-size": "64", "--batch-size": "64"}
    with pytest.raises(SystemExit):                       # B/4 is not a whole number of groups of 8
        compare.main(["--batch-size", "240", "--arms", "on_policy", "replay_y4", "control_y4"])
    cn = records.arm_flags("control_nonzero", 256, 2, 8, 0.3)
    # filtered on-policy: R = B/y per round, each kept rollout used once, N leaves room for a round's leftovers
    assert parse(cn) == {"--prompts-per-round": "16", "--buffer-size": "384", "--batch-size": "256"}
    assert cn[-2:] == ["--skip-zero-advantage", "--no-reuse"]


@pytest.mark.slow
def test_quick_comparison_writes_the_summary_records_and_the_plot(tmp_path, tiny_path, monkeypatch):
    # two arms (each run is a process of its own: the suite's slowest test); the control's flags are
    # checked in test_arms_follow_their_definitions
    cost = cost_file(tmp_path / "cost.json", lambda R: 0.001 * R, lambda B: 0.002 * B)
    record_dir = tmp_path / "records"
    summary = compare.main(["--quick", "--output-dir", str(tmp_path / "out"), "--arms", "on_policy", "replay",
                            "--cost", cost, "--records", str(record_dir),
                            "--train-args=--no-plot"])     # no run's own curves.png: 4 s of its 15
    out = tmp_path / "out"
    on_disk = json.load(open(out / "summary.json"))
    assert on_disk["target_accuracy"] == summary["target_accuracy"]
    assert set(on_disk["arms"]) == {"on_policy", "replay"}
    assert (on_disk["task"], on_disk["model"], on_disk["cost"]["curves"]) == ("addition", "tiny", ["plain"])
    finals = []
    for name, arm in on_disk["arms"].items():
        assert isinstance(arm["final_accuracy"], float) and 0 <= arm["final_accuracy"] <= 1
        assert arm["seeds"] == 2 and isinstance(arm["entropy"], float) and arm["entropy"] > 0
        for key in ("tokens_to_target", "seconds_to_target"):
            assert arm[key] is None or arm[key] > 0
        assert len(arm["replicates"]) == 2 and (arm["R"], arm["B"]) == {"on_policy": (256, 256),
                                                                         "replay": (128, 256)}[name]
        for seed in range(2):
            folder = out / name / f"seed{seed}"
            rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
            assert rows[-1]["gen_tokens"] >= on_disk["budget_tokens"] == 5_000     # one budget for every run
            # the run read back from its folder and from its record (a few KB, no checkpoints): the same
            (record,) = (record_dir / name).glob(f"seed{seed}-*.json")       # keyed by the run's flags
            assert record.stat().st_size < 20_000
            from_folder = records.read_record(records.run_record(str(folder)), on_disk["grid_tokens"])
            assert records.read_record(json.load(open(record)), on_disk["grid_tokens"]) == from_folder
            assert {k: v for k, v in arm["replicates"][seed].items() if k != "reach"} == from_folder
            if name == "on_policy":
                finals.append(from_folder["accuracy"])
        point = arm["projected_seconds_to_target"]["plain"]["seconds"]     # rounds x 0.001 R + steps x 0.002 B
        assert point == pytest.approx(arm["rounds_to_target"] * 0.001 * arm["R"] + arm["steps_to_target"] * 0.002 * arm["B"])
    assert on_disk["target_accuracy"] == pytest.approx(stats.final_accuracy(
        [sum(x) / 2 for x in zip(*finals)]))                                 # the mean curve's last three
    assert on_disk["arms"]["on_policy"]["tokens_to_target"] is not None
    arm = on_disk["arms"]["replay"]
    lo, hi = arm["accuracy_diff_ci"]
    assert lo <= hi and set(arm["projected_time_ratio"]) == {"plain", "gen share 86%", "gen share 96%"} and arm["verdict"]
    assert "vs_control" not in arm and len(arm["time_ratio_ci"]) == 2
    assert (out / "curves.png").stat().st_size > 10_000
    # the comparison again, elsewhere, with the records: nothing runs, the same figures
    monkeypatch.setattr(compare, "run_train", lambda *a: pytest.fail("a recorded run ran again"))
    again = compare.main(["--quick", "--output-dir", str(tmp_path / "again"), "--arms", "on_policy", "replay",
                          "--cost", cost, "--records", str(record_dir), "--train-args=--no-plot"])
    assert again["arms"] == summary["arms"]


def test_missing_matplotlib_is_a_message_not_a_crash(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # import matplotlib -> ImportError
    readout.plot({"arms": {}, "target_accuracy": 0.5}, str(tmp_path / "curves.png"))
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "curves.png").exists()


def test_lr_is_chosen_by_tokens_to_hold_the_target_ties_by_the_area_and_the_other_rule_is_kept():
    steady = [0.1, 0.2, 0.3, 0.4, 0.55, 0.55, 0.55, 0.55, 0.55]     # holds 0.5 from 3.67 rounds; area 0.417
    wobbly = [0.1, 0.7, 0.7, 0.7, 0.3, 0.3, 0.6, 0.6, 0.6]          # first at once, holds from 5.67; area 0.511
    never = [0.1] * 9
    sweep = stats.choose_lr({1e-3: [run_of(steady)], 3e-3: [run_of(wobbly)], 3e-4: [run_of(never)]}, 0.5)
    assert sweep["chosen"] == 1e-3 and sweep["area_choice"] == 3e-3 and not sweep["rules_agree"]
    assert sweep["tokens_to_hold"] == {3e-4: None, 1e-3: pytest.approx(3666.67, abs=0.01),
                                       3e-3: pytest.approx(5666.67, abs=0.01)}
    assert sweep["mean_score"][3e-3] == pytest.approx(4.6 / 9) and not sweep["on_grid_edge"]
    # neither reaches: the larger area; all equal: the smaller lr; the best on the edge: widen the grid
    low, lower = [0.1, 0.3, 0.3, 0.3, 0.3], [0.1, 0.2, 0.2, 0.2, 0.2]
    assert stats.choose_lr({1e-3: [run_of(lower)], 3e-3: [run_of(low)]}, 0.5)["chosen"] == 3e-3
    assert stats.choose_lr({1e-3: [run_of(low)], 3e-3: [run_of(low)]}, 0.5)["chosen"] == 1e-3
    assert stats.choose_lr({1e-3: [run_of(steady)], 3e-3: [run_of(never)]}, 0.5)["on_grid_edge"]
    # the sweep's target: the highest on-policy target over the lrs
    assert stats.sweep_target({1e-3: [run_of(steady)], 3e-3: [run_of(wobbly)]}) == 0.6
    assert stats.sweep_score({"accuracy": [0.2, 0.4, 0.9]}) == pytest.approx(0.5)


def test_reach_hold_and_the_fall_after_reaching_by_hand():
    on = run_of([0.1, 0.3, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])          # target 0.5, reached and held at eval 2
    rep = run_of([0.1, 0.7, 0.7, 0.7, 0.2, 0.2, 0.6, 0.6])         # first at eval 1, falls to 0.2, holds from 6
    assert stats.first_reach_index(rep["accuracy"], 0.5) == 1 and stats.reach_index(rep["accuracy"], 0.5) == 6
    assert stats.fall_after_reach(rep["accuracy"], 0.5) == pytest.approx(0.3)
    assert stats.fall_after_reach(on["accuracy"], 0.5) == 0.0 and stats.fall_after_reach([0.1] * 5, 0.5) is None
    f = stats.figures({"on_policy": [on], "replay": [rep]})
    a = f["arms"]["replay"]
    assert f["target"] == 0.5 and a["evals_in_rise"] == 1 and f["arms"]["on_policy"]["evals_in_rise"] == 2
    assert a["first"]["tokens"] == pytest.approx(1000 * 0.4 / 0.6)        # (0.5 - 0.1) / (0.7 - 0.1) of eval 0 -> 1
    assert a["tokens"] == pytest.approx(5750)                               # (0.5 - 0.2) / (0.6 - 0.2) of eval 5 -> 6
    vs = a["vs"]["on_policy"]
    assert vs["token_ratio"] == pytest.approx(5750 / 2000) and vs["first_token_ratio"] == pytest.approx(1 / 3)
    assert vs["instability_diff"] == pytest.approx(0.3)
    assert stats.verdict([2.5, 3.2], [-0.02, 0.02], [0.2, 0.5], 1) == (
        "to hold the target more tokens, to first reach it fewer tokens: it rises sooner but falls back: the "
        "difference comes from holding; final accuracy within noise (the fastest rise spans 1 eval(s), fewer "
        "than 5: too coarse to tell; more evals or a smaller budget)")
    assert stats.verdict([2.5, None], [-0.2, -0.1], [0.9, 1.1], 6) == (
        "to hold the target more tokens, to first reach it tokens within noise: the difference comes from "
        "holding the target, not the rise; lower final accuracy")


COMMON = ["--seeds", "3", "--evals", "4", "--bootstrap", "10", "--jobs", "1"]


def test_replicates_vary_the_warm_start_unless_one_model(tmp_path, compare_runs):
    compare.main(COMMON + ["--output-dir", str(tmp_path), "--sweep-lr", "1e-3", "2e-3"])
    builds = sorted(b[1:] for b in compare_runs.builds)
    assert builds == [(s, 0) for s in (0, 1, 2, 1000, 1001)]                # reported and sweep replicates
    pairs = {(cfg.warm_start_seed, cfg.seed) for _, cfg in compare_runs.runs}
    assert pairs == {(i, i) for i in (0, 1, 2, 1000, 1001)}                 # replicate i: model i, seed i
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["replicates"].startswith("warm-start seed i") and summary["lr_sweep"]["seeds"] == [1000, 1001]
    assert summary["lr_sweep"]["arms"]["replay"]["chosen"] == 1e-3            # equal scores: the smaller
    compare_runs.runs.clear()
    compare.main(COMMON + ["--one-model", "--output-dir", str(tmp_path / "one")])
    assert {cfg.warm_start_seed for _, cfg in compare_runs.runs} == {0}
    assert json.load(open(tmp_path / "one" / "summary.json"))["replicates"].startswith("one model")
    for flags in ("--warm-start-steps 300", "--warm-start-steps=300"):     # built as the runs ask
        compare_runs.builds.clear()
        compare.main(COMMON + ["--one-model", "--output-dir", str(tmp_path / "ws"), f"--train-args={flags}"])
        assert compare_runs.builds == [("addition", 0, 300)]


def refused(argv, capsys, compare_runs) -> str:
    """compare.main(argv) must stop with one line (exit 2) before building or running anything."""
    with pytest.raises(SystemExit) as e:
        compare.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert compare_runs.builds == compare_runs.runs == []
    return err[0]


@pytest.mark.parametrize("train_args, named", [
    ("--lr 5e-4 --seed 7", "--lr, --seed"),        # the sweep's lr and the replicate's seed would lose
    ("--warm-start-seed 3", "--warm-start-seed"),
    ("--see 7", "--seed"),                          # abbreviated, as train.py's parser reads it
    ("--buffer-size 64 --batch-size 64", "--buffer-size, --batch-size"),
    ("--output-dir elsewhere", "--output-dir"),
    ("--eval-every 5", "--eval-every"),             # the runs evaluate at token thresholds
    ("--resume runs/x", "--resume"),
    ("--no-such-flag 1", "unrecognized arguments: --no-such-flag"),
])
def test_train_args_may_not_set_what_compare_sets_per_run(tmp_path, capsys, compare_runs, train_args, named):
    """--train-args came after the arm's own flags, so its --lr or --seed silently won over the
    sweep's lr and the replicate seeds (the held-out sweep replicates became the reported ones)."""
    err = refused(["--output-dir", str(tmp_path), "--sweep-lr", "1e-3", "2e-3", "--train-args", train_args],
                  capsys, compare_runs)
    assert named in err


def test_an_arms_own_flag_is_refused_in_train_args_only_when_that_arm_runs(tmp_path, capsys, compare_runs):
    err = refused(["--output-dir", str(tmp_path), "--arms", "on_policy", "replay_ppo", "--train-args", "--loss asymre"],
                  capsys, compare_runs)
    assert "--train-args --loss" in err
    compare.main(COMMON + ["--output-dir", str(tmp_path), "--train-args", "--loss ppo --system-prompt 'Be brief.'"])
    assert {(cfg.loss, cfg.system_prompt) for _, cfg in compare_runs.runs} == {("ppo", "Be brief.")}   # every run


@pytest.mark.parametrize("argv, message", [
    (["--sweep-lr"], "--sweep-lr: expected at least one argument"),
    (["--one-model", "--sweep-lr", "1e-3", "2e-3"], "--sweep-lr with --one-model"),
    (["--quick", "--sweep-lr", "1e-3", "2e-3"], "--sweep-lr with --quick"),
    (["--sweep-seeds", "3"], "--sweep-seeds 3: replicates of the lr sweep"),
    (["--keep-correct-frac", "0.5"], "--keep-correct-frac 0.5: the delta of the replay_pbr arm"),
])
def test_settings_that_would_do_nothing_or_mislead_are_refused(tmp_path, capsys, compare_runs, argv, message):
    """--sweep-lr with no values ran without a sweep and reported the lr as given; with one model the
    sweep's replicates start where the reported ones do (only the RL seed differs): not held out."""
    assert message in refused(["--output-dir", str(tmp_path)] + argv, capsys, compare_runs)


def test_quick_keeps_the_settings_given_and_a_real_models_sweep_says_what_is_held_out(tmp_path, compare_runs):
    compare.main(["--quick", "--seeds", "3", "--evals", "3", "--output-dir", str(tmp_path), "--arms", "on_policy"])
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["arms"]["on_policy"]["seeds"] == 3 and len(summary["grid_tokens"]) == 4
    assert summary["budget_tokens"] == 5_000                      # the --quick default where none was given
    compare.main(COMMON + ["--output-dir", str(tmp_path / "real"), "--model", "some/model", "--sweep-lr", "1e-3"])
    assert json.load(open(tmp_path / "real" / "summary.json"))["lr_sweep"]["held_out"] == \
        "the RL seed only: every replicate starts from some/model"


def test_one_eval_may_not_stand_for_two_grid_points(tmp_path):
    """A round that generates more tokens than the eval interval (GSM8K on a real model: ~51k tokens
    a round against a 30k interval) leaves one eval for two grid points: refused, with what to change."""
    counters = lambda k: {"step": k, "round": k, "gen_tokens": 51_000 * k, "gen_seconds": k, "train_seconds": k}
    step = {"rollout_entropy": 0.5, "is_truncated_frac": 0.0, "age_mean": 0.0, "age_max": 0, "is_ratio_mean": 1.0,
            "is_ratio_max": 1.0}
    rows = [{**counters(0), "eval_accuracy": 0.1},
            {**counters(1), **step}, {**counters(1), "eval_accuracy": 0.2},
            {**counters(2), **step}, {**counters(2), "eval_accuracy": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.json").write_text(json.dumps({"prompts_per_round": 32, "num_generations": 8, "batch_size": 256}))
    assert records.read_record(records.run_record(str(tmp_path)), [0, 51_000, 102_000])["accuracy"] == [0.1, 0.2, 0.3]   # one eval each
    with pytest.raises(stats.CompareError, match="raise --budget-tokens or --early-tokens, or lower --evals"):
        records.read_record(records.run_record(str(tmp_path)), [0, 30_000, 60_000, 90_000])




def test_runs_recorded_are_read_from_their_records_not_run_again(tmp_path, monkeypatch):
    """--records: each finished run leaves DIR/<arm>/seed<i>-<key>.json; a comparison elsewhere (another output
    folder, another machine) with the same flags reads them and runs nothing, builds no model; a changed
    flag runs them again."""
    calls = []
    monkeypatch.setattr(compare, "build_tiny_model", lambda task, seed, steps=0: calls.append(("build", seed)))
    monkeypatch.setattr(compare, "run_train", lambda argv, out, env=None: calls.append(("run", out)) or fake_train(argv, out))
    monkeypatch.setattr(compare, "plot", lambda *a: None)
    common = ["--seeds", "2", "--evals", "4", "--bootstrap", "10", "--jobs", "1", "--budget-tokens", "4000",
              "--records", str(tmp_path / "records")]
    first = compare.main(common + ["--output-dir", str(tmp_path / "a")])
    assert len([c for c in calls if c[0] == "run"]) == 6 and len([c for c in calls if c[0] == "build"]) == 2
    (path,) = (tmp_path / "records" / "replay").glob("seed1-*.json")
    record = json.load(open(path))
    assert "--output-dir" not in record["argv"] and record["argv"][record["argv"].index("--seed") + 1] == "1"
    assert records.read_record(record, first["grid_tokens"]) == records.read_record(
        records.run_record(str(tmp_path / "a" / "replay" / "seed1")), first["grid_tokens"])
    # the staleness of each arm, from the records: replay y = 2 (ages 0 and 1), on-policy (age 0)
    assert first["arms"]["replay"]["age_mean"] == 0.5 and first["arms"]["replay"]["age_max"] == 1
    assert first["arms"]["on_policy"]["age_mean"] == 0 and first["arms"]["control"]["age_max"] == 0
    assert first["arms"]["replay"]["truncated_frac_max"] == 0.01
    assert 0.004 < first["arms"]["replay"]["truncated_frac"] < 0.006           # every other step
    # and every update's importance ratios, so a sentence about staleness can be recomputed from the record
    steps = len(record["per_step"]["is_ratio_max"])
    assert steps == record["last"]["step"] and record["per_step"]["is_ratio_max"][:2] == [1.6, 1.5]
    assert record["per_step"]["is_truncated_frac"][:2] == [0.01, 0.0] and first["arms"]["replay"]["is_ratio_max"] == 1.6
    calls.clear()
    again = compare.main(common + ["--output-dir", str(tmp_path / "b")])
    assert calls == [] and again["arms"] == first["arms"]
    compare.main(common + ["--output-dir", str(tmp_path / "c"), "--lr", "2e-3"])
    assert len([c for c in calls if c[0] == "run"]) == 6
    # the same flags from another starting model (the warm start's recipe changed: another spec) run again
    assert record["model"] == records.starting_model("tiny", "addition", 1)
    calls.clear()
    from infra import demo_model
    monkeypatch.setitem(demo_model.WARM_START, "lr", 1e-2)
    compare.main(common + ["--output-dir", str(tmp_path / "d")])
    assert len([c for c in calls if c[0] == "run"]) == 6


def decision_summary(tmp_path):
    """summary.json of the constructed arms (on-policy, replay and control reach the target at the same
    tokens: 3000 / R rounds and steps), two identical replicates each."""
    results = {arm: runs * 2 for arm, runs in arms_reaching_at_equal_tokens().items()}
    args = argparse.Namespace(task="addition", model="tiny", train_args="", target_frac=1.0, bootstrap=50,
                              one_model=True, budget_tokens=5000, jobs=2, sweep_lr=None, batch_size=256,
                              replay_ratio=2, num_generations=8, keep_correct_frac=0.3)
    summary = summaries.summarize(results, args, [0, 1000, 2000, 3000, 4000, 5000], {"on_policy": 1e-3})
    summary["lr_sweep"] = {"arms": {"on_policy": {"mean_score": {1e-3: 0.9, 2e-3: 0.8}, "chosen": 1e-3,
                                                  "on_grid_edge": True}}}        # its lrs become strings in JSON
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    return summary, path


def test_the_decision_reads_a_summary_and_a_cost_file(tmp_path, capsys):
    summary, path = decision_summary(tmp_path)
    reach = summary["arms"]["replay"]["replicates"][1]["reach"]          # each replicate's own reach point
    assert reach == {"tokens": 3000, "seconds": 3.0, "rounds": pytest.approx(3000 / 128),
                     "steps": pytest.approx(3000 / 128)}
    assert summary["arms"]["replay"]["vs_control"]["arm"] == "control"
    flat = cost_file(tmp_path / "flat.json", lambda R: 1.0, lambda B: 0.001 * B)
    answer = compare.main(["--summary", str(path), "--cost", flat])
    out = capsys.readouterr().out
    assert "task addition, model tiny" in out and "plain generation): on_policy reaches the target first" in out
    assert "lr sweep on_policy: mean accuracy 0.001: 0.900, 0.002: 0.800 -> 0.001 (on the edge of the grid)" in out
    # measured, every arm took 3 s; the flat curve projects replay at 2x on-policy: the check says they disagree
    assert "measured time x1.00 [1.00, 1.00]; projected time (plain) x2.00 [2.00, 2.00] (outside the measured ratio's interval" in out
    on, rep, ctl = (3000 / 256) * (1 + 0.256), (3000 / 128) * (1 + 0.256), (3000 / 128) * (1 + 0.128)
    assert answer["plain"]["fastest"] == "on_policy" and answer["plain"]["seconds"] == pytest.approx(on)
    # on-policy's time / each other arm's, point [interval]: identical replicates, no spread
    assert answer["plain"]["ratio_to"] == {"replay": [pytest.approx(on / rep)] * 3,
                                           "control": [pytest.approx(on / ctl)] * 3}
    assert answer["measured"]["ratio_to"]["replay"][0] == pytest.approx(1.0)   # 3 s each, as logged
    # a curve that costs more per rollout the bigger the call: the control's small rounds and batches win
    steep = cost_file(tmp_path / "steep.json", lambda R: 1e-5 * R * R, lambda B: 1e-5 * B * B)
    steep_answer = compare.decide(str(path), steep)["plain"]
    assert steep_answer["fastest"] == "control" and steep_answer["seconds"] == pytest.approx(
        (3000 / 128) * 2e-5 * 128 * 128)
    # a summary from before per-replicate runs: the same point figures, no intervals
    old = json.loads(path.read_text())
    del old["args"], old["task"]
    for arm in old["arms"].values():
        del arm["replicates"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    points = compare.decide(str(tmp_path / "old.json"), flat)
    assert points["plain"]["fastest"] == "on_policy" and points["plain"]["ratio_to"]["replay"] == [pytest.approx(on / rep)]
    assert "task and model: not recorded" in capsys.readouterr().out
    with pytest.raises(SystemExit):                      # outside the curve: one line, no answer
        compare.main(["--summary", str(path), "--cost", cost_file(tmp_path / "big.json", lambda R: 1.0,
                                                                  lambda B: 1.0, sizes=(256, 512))])


def test_every_summary_says_in_its_verdict_what_its_figures_give(tmp_path):
    """Each verdict line of every summary in docs/results/ (and of a fresh one) is what its own intervals
    give; a line edited by hand, or figures changed under it, fails here."""
    import glob
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    summaries = [p for p in glob.glob(os.path.join(root, "docs", "results", "**", "*.json"), recursive=True)
                 if "records" not in p and "arms" in json.load(open(p))]
    assert len(summaries) >= 7
    for path in summaries:
        assert stats.verdicts_that_disagree(json.load(open(path))) == [], path
    s = json.load(open(max(summaries, key=os.path.getsize)))
    name = next(a for a, e in s["arms"].items() if "verdict" in e)
    higher = "higher final accuracy" in s["arms"][name]["verdict"]
    s["arms"][name]["accuracy_diff_ci"] = [-0.02, -0.01] if higher else [0.01, 0.02]   # figures moved, not the line
    wrong = stats.verdicts_that_disagree(s)
    assert len(wrong) == 1 and ("lower" if higher else "higher") + " final accuracy" in wrong[0]


def test_a_verdict_tells_a_slow_rise_from_a_fall_back():
    # replay_y4 / control_y4 on the written-work task: 1.57x to first reach, 3.23x to hold
    assert stats.verdict([2.98, 8.75], [-0.073, -0.024], [1.05, 2.29], 6).startswith(
        "to hold the target more tokens, to first reach it more tokens: slower to rise, and slower still to hold: "
        "most of the difference comes from falling back; lower final accuracy")
    assert stats.verdict([1.2, 2.0], [-0.01, 0.01], [1.1, 1.5], 6) == (       # overlapping: the rise
        "to hold the target more tokens, to first reach it more tokens: the difference comes from the rise; "
        "final accuracy within noise")


def test_a_summary_where_no_replicate_set_touches_the_target_says_so():
    """Replicates that never touch the mean curve's target in any arm: no fastest rise, no crash."""
    high, low = [0.1] + [0.5] * 6, [0.1] + [0.3] * 6          # the mean: 0.4, which the low replicate never touches
    results = {"on_policy": [run_of(high), run_of(low)], "replay": [run_of(low, R=50), run_of(high, R=50)]}
    args = argparse.Namespace(target_frac=1.0, bootstrap=20, model="tiny", one_model=True, task="addition",
                              train_args=[], budget_tokens=6000, jobs=1, batch_size=100, replay_ratio=2,
                              num_generations=2, keep_correct_frac=0.3, sweep_lr=None)
    s = summaries.summarize(results, args, [0, 1000, 2000, 3000, 4000, 5000, 6000], {"on_policy": 1e-3, "replay": 1e-3})
    assert s["target_accuracy"] == pytest.approx(0.4) and s["rise"]["fastest_arm"] is None and not s["rise"]["resolved"]
    assert s["arms"]["replay"]["tokens_to_first_reach"] is None and stats.verdicts_that_disagree(s) == []


def test_a_denser_grid_early_and_the_uniform_one_unchanged():
    """--early-tokens puts --early-evals evals evenly up to it, then --evals to the budget, passed to the
    runs as --eval-at-tokens; without it the grid and the flag are those of the records before it
    (--eval-every-tokens), so a record whose flags did not change is still read, not run."""
    ns = lambda **kw: types.SimpleNamespace(**{"early_tokens": 0, "early_evals": None, **kw})
    uniform = records.token_grid(ns(budget_tokens=40_000, evals=20))
    assert uniform == list(range(0, 40_001, 2_000)) and records.eval_flags(uniform) == ["--eval-every-tokens", "2000"]
    odd = records.token_grid(ns(budget_tokens=1_000, evals=3))          # ceil(1000 / 3) = 334: the end is the budget
    assert odd == [0, 334, 668, 1_000] and records.eval_flags(odd) == ["--eval-every-tokens", "334"]
    early = records.token_grid(ns(budget_tokens=40_000, evals=4, early_tokens=6_000, early_evals=6))
    assert early == [0, 1_000, 2_000, 3_000, 4_000, 5_000, 6_000, 14_500, 23_000, 31_500, 40_000]
    assert records.eval_flags(early) == ["--eval-at-tokens", "1000,2000,3000,4000,5000,6000,14500,23000,31500,40000"]
    with pytest.raises(SystemExit):         # every 2 tokens: 5 evals up to 10, not the 6 asked for
        compare.parse(["--early-tokens", "10", "--early-evals", "6", "--output-dir", "/tmp/x"])


def test_a_models_own_defaults_do_not_reach_the_arms(needs_smollm2):
    """compare.py --model smollm2: each arm's run gets train.py's temperature and no zero-advantage
    filter (smollm2's own defaults would change them), unless the arm or --train-args sets them."""
    args = compare.parse(["--model", "smollm2", "--arms", "on_policy", "replay_nonzero", "--output-dir", "/tmp/x"])
    assert records.plain_flags(args) == ["--no-skip-zero-advantage", "--temperature", "1.0"]
    for arm, skip in (("on_policy", False), ("replay_nonzero", True)):
        cfg = train.parse_config(records.plain_flags(args) + records.own_flags(args, arm, 0, 1e-3, "/tmp/x/r"))
        assert (cfg.temperature, cfg.skip_zero_advantage) == (1.0, skip)
    given = compare.parse(["--model", "smollm2", "--output-dir", "/tmp/x", "--train-args", "--temperature 0.7"])
    cfg = train.parse_config(records.plain_flags(given) + records.own_flags(given, "replay", 0, 1e-3, "/tmp/x/r")
                             + given.train_args)
    assert cfg.temperature == 0.7
    assert records.plain_flags(compare.parse(["--output-dir", "/tmp/x"])) == []     # the tiny model: none


def test_a_run_with_no_step_row_is_named_in_one_line(tmp_path):
    """A run whose budget ended before its first update (its rows: evals and rounds without an
    update) is reported as such, not a crash on the mean of nothing."""
    counters = lambda k: {"step": 0, "round": k, "gen_tokens": 300 * k, "gen_seconds": k, "train_seconds": 0}
    rows = [{**counters(0), "eval_accuracy": 0.1}, {**counters(1), "updates": 0, "reward": 0.0},
            {**counters(2), "updates": 0, "reward": 0.0}, {**counters(2), "eval_accuracy": 0.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.json").write_text(json.dumps({"prompts_per_round": 4, "num_generations": 4, "batch_size": 16}))
    with pytest.raises(stats.CompareError, match="the run took no optimizer step"):
        records.run_record(str(tmp_path))


# ---- issue 52: the design fixed before the powered comparison --------------------------------
def curve_run(accs, tokens, cpu_share=1.0, **extra):
    """A constructed run at these tokens: as many rounds and steps as thousands of tokens, 1 s a
    round, cpu_share of it CPU seconds."""
    rounds = [t / 1000 for t in tokens]
    return {**run_of(accs, R=16, B=16), "tokens": tokens, "rounds": rounds, "steps": rounds,
            "seconds": rounds, "cpu_seconds": [cpu_share * r for r in rounds], **extra}


def test_a_fixed_target_first_reach_with_wall_and_cpu_seconds_and_the_area_by_hand():
    """--target: the target is the one given, in every draw (on-policy's final accuracy would be
    0.5). First reach of 0.45, by hand: on-policy between 0.3 at 1,000 and 0.5 at 2,000 tokens, 3/4
    of the way (1,750 tokens, 1.75 s, CPU 1.75 s); replay between 0.1 at 0 and 0.5 at 1,000, 7/8 of
    the way (875 tokens, 0.875 s, CPU half of it). The area (mean accuracy over the tokens, by
    trapezoids): on-policy (200 + 400 + 500) / 3000, replay (300 + 500 + 500) / 3000."""
    tokens = [0, 1000, 2000, 3000]
    on = [curve_run([0.1, 0.3, 0.5, 0.5], tokens)]
    rep = [curve_run([0.1, 0.5, 0.5, 0.5], tokens, cpu_share=0.5)]
    assert stats.area(on[0]) == pytest.approx(1100 / 3000)
    assert stats.area(rep[0]) == pytest.approx(1300 / 3000)
    fig = stats.figures({"on_policy": on, "replay": rep}, target=0.45)
    assert fig["target"] == 0.45
    assert stats.figures({"on_policy": on, "replay": rep})["target"] == pytest.approx(0.5)
    first = fig["arms"]["replay"]["first"]
    assert first["tokens"] == pytest.approx(875) and first["cpu_seconds"] == pytest.approx(0.4375)
    assert fig["arms"]["on_policy"]["first"]["tokens"] == pytest.approx(1750)
    vs = fig["arms"]["replay"]["vs"]["on_policy"]
    assert vs["first_token_ratio"] == pytest.approx(0.5)
    assert vs["first_time_ratio"] == pytest.approx(0.5)
    assert vs["first_cpu_time_ratio"] == pytest.approx(0.25)
    assert vs["area_diff"] == pytest.approx(200 / 3000)
    ci = stats.bootstrap({"on_policy": on * 3, "replay": rep * 3}, 20, target=0.45)
    assert ci["target"] == [0.45, 0.45]
    entry = stats.pair_entry(vs, ci["arms"]["replay"]["vs"]["on_policy"])
    assert entry["first_reach_cpu_time_ratio"] == pytest.approx(0.25)
    assert entry["area_diff_ci"] == [pytest.approx(200 / 3000)] * 2
    assert "entropy_half_diff" not in entry          # no record of these runs has it
    # a record without CPU seconds (before them): no CPU ratio rather than a made-up one
    old = [{k: v for k, v in r.items() if k != "cpu_seconds"} for r in rep]
    vs = stats.figures({"on_policy": on, "replay": old}, target=0.45)["arms"]["replay"]["vs"]
    assert math.isnan(vs["on_policy"]["first_cpu_time_ratio"])


def test_entropy_over_the_second_half_has_its_own_paired_interval():
    """Replicate i of replay ends its second half 0.1, 0.2 and 0.3 nats below on-policy's (its last
    5% of steps: level): the point is -0.2, every draw's mean lies within [-0.3, -0.1]."""
    tokens, accs = [0, 1000, 2000, 3000], [0.1, 0.3, 0.5, 0.5]
    on = [curve_run(accs, tokens, entropy_half=h) for h in (0.5, 0.6, 0.7)]
    rep = [curve_run(accs, tokens, entropy_half=h - d)
           for h, d in ((0.5, 0.1), (0.6, 0.2), (0.7, 0.3))]
    point = stats.figures({"on_policy": on, "replay": rep})["arms"]["replay"]["vs"]["on_policy"]
    ci = stats.bootstrap({"on_policy": on, "replay": rep}, 200)["arms"]["replay"]["vs"]["on_policy"]
    entry = stats.pair_entry(point, ci)
    assert entry["entropy_half_diff"] == pytest.approx(-0.2) and entry["entropy_diff"] == 0
    lo, hi = entry["entropy_half_diff_ci"]
    assert -0.3 - 1e-9 <= lo < -0.2 < hi <= -0.1 + 1e-9


def metrics_rows():
    """A filtered run's rows (S = 8, G = 4, P = 4), made by hand: round 1 stores 5 of its 16 (half
    its groups all-equal: 8 of zero advantage, so 3 thrown away by the cap) and steps; round 2
    stores none (every group all-equal: 16 of zero advantage, an empty round, no step); round 3
    stores 8 (8 of zero advantage) and steps twice (K = 2, two rows of one round). Tokens 100 a
    round: the second half is rounds 2 and 3."""
    def c(rnd, step, generated, stored):
        return {"round": rnd, "step": step, "gen_tokens": 100 * rnd, "gen_seconds": rnd,
                "train_seconds": step / 2, "rollouts_generated": generated,
                "rollouts_stored": stored, "rollouts_trained": 16 * step}
    step = {"is_truncated_frac": 0.0, "age_mean": 0.5, "age_max": 1, "is_ratio_mean": 1.0,
            "is_ratio_max": 1.2, "left_by_uses": [0, 2]}
    return [{**c(0, 0, 0, 0), "eval_accuracy": 0.2},
            {**c(1, 1, 16, 5), "rollout_entropy": 0.9, "zero_adv_frac": 0.5, **step},
            {**c(2, 1, 32, 5), "rollout_entropy": 0.6, "zero_adv_frac": 1.0, "updates": 0},
            {**c(3, 2, 48, 13), "rollout_entropy": 0.2, "zero_adv_frac": 0.5, **step},
            {**c(3, 3, 48, 13), "rollout_entropy": 0.2, "zero_adv_frac": 0.5, **step},
            {**c(3, 3, 48, 13), "eval_accuracy": 0.3}]


def test_rounds_are_counted_from_the_rows_kept_beside_the_record(tmp_path):
    rows = metrics_rows()
    cfg = {"prompts_per_round": 4, "num_generations": 4, "batch_size": 16,
           "skip_zero_advantage": True}
    record = records.record_of(rows, cfg)
    assert record["rounds"] == {"rounds": 3, "empty_rounds": 1, "discard_rounds": 1,
                                "generated": 48, "zero_advantage": 32, "stored": 13, "discarded": 3,
                                "steps": 3}
    assert record["entropy_second_half"] == pytest.approx(0.4)     # (0.6 + 0.2) / 2: round 3 once
    unfiltered = records.record_of(rows, {**cfg, "skip_zero_advantage": False})["rounds"]
    assert unfiltered["zero_advantage"] == 0 and unfiltered["discarded"] == 48 - 13
    without = [{k: v for k, v in r.items() if k != "zero_adv_frac"} for r in rows]
    with pytest.raises(stats.CompareError, match="zero_adv_frac"):
        records.round_counts(without, True)
    # the rows, gzipped beside the record, read back as they were; the same rows, the same bytes
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = str(tmp_path / "records" / "on_policy" / "seed0-abc.json")
    records.save_rows(path, str(run))
    assert records.rows_path(path).endswith("seed0-abc.metrics.jsonl.gz")
    assert records.read_rows(path) == rows
    assert records.record_of(records.read_rows(path), cfg) == record
    first = open(records.rows_path(path), "rb").read()
    records.save_rows(path, str(run))
    assert open(records.rows_path(path), "rb").read() == first
    last = {"round": 3, "step": 3, "gen_seconds": 3, "train_seconds": 1.5}
    read = records.read_record({**record, "last": last}, [0, 300])
    assert read["entropy_half"] == pytest.approx(0.4) and read["rounds_counted"]["discarded"] == 3


def simulated_discards(P: int, G: int, S: int, N: int, B: int, filtered: bool,
                       rounds: int = 3000) -> int:
    """train.py's synchronous rule, played out: a round stores at most room = max(S - new since the
    last step, B - buffer fill) of what it keeps (with the filter, the groups with mixed rewards,
    each of a random number); a step once B are stored and S new."""
    rng, fill, fresh, thrown = __import__("random").Random(0), 0, 0, 0
    for _ in range(rounds):
        kept = G * rng.randint(0, P) if filtered else P * G
        stored = min(kept, max(S - fresh, B - fill))
        thrown += kept - stored
        fill, fresh = min(N, fill + stored), fresh + stored
        if fill >= B and fresh >= S:
            fresh = 0
    return thrown


@pytest.mark.parametrize("P, S, filtered, possible", [
    (4, 16, True, True), (4, 8, True, True),            # the committed SmolLM2 arms: the cap binds
    (1, 16, True, False), (1, 8, True, False),          # one prompt a round, S a multiple of G
    (1, 6, True, True),                                 # S not a multiple of G
    (2, 16, False, False), (4, 8, False, True), (4, 16, False, False)])
def test_the_rule_for_discards_is_train_pys_played_out(P, S, filtered, possible):
    G, B = 4, 16
    flags = ["--prompts-per-round", str(P), "--num-generations", str(G), "--batch-size", str(B),
             "--buffer-size", str(B)] + (["--skip-zero-advantage"] if filtered else [])
    assert records.discards_possible(flags + ["--new-per-update", str(S)]) is possible
    assert (simulated_discards(P, G, S, B, B, filtered) > 0) is possible
    assert records.discards_possible(flags) is False                  # no S: every round is stored
    assert records.discards_possible(["--generators", "1"] + flags) is None   # async: not this rule


def test_what_two_arms_differ_in_is_their_flags():
    def arm(N, B, S):
        return ["--prompts-per-round", "4", "--buffer-size", str(N), "--batch-size", str(B),
                "--new-per-update", str(S)]
    replay, control = arm(16, 16, 8), arm(8, 8, 8)
    assert records.flags_differ(replay, control) == {"--batch-size": [16, 8],
                                                     "--buffer-size": [16, 8]}
    assert records.flags_differ(replay, replay) == {}
    differs = records.flags_differ(["--generators", "1"] + replay, replay)  # known or not
    assert list(differs) == ["--generators"] and differs["--generators"] in ([1, 0], ["1", None])


WIDE = "--prompts-per-round 16 --buffer-size 128 --batch-size 128"


def test_an_arm_of_its_own_flags_a_fixed_target_and_more_pairs(tmp_path, compare_runs):
    """--arm NAME FLAGS runs an arm of those train.py flags; --pairs reads it against another arm,
    paired, with the flags the two differ in; --target and --target-rule are stored as given; with
    --records every run's rows lie beside its record and read back."""
    compare.main(COMMON + ["--output-dir", str(tmp_path / "out"), "--arms", "on_policy", "replay",
                           "wide", "--arm", "wide", WIDE, "--pairs", "wide:replay", "--target",
                           "0.3", "--target-rule", "first", "--records", str(tmp_path / "rec")])
    assert {(c.prompts_per_round, c.buffer_size, c.batch_size) for out, c in compare_runs.runs
            if "/wide/" in out} == {(16, 128, 128)}
    s = json.load(open(tmp_path / "out" / "summary.json"))
    assert s["target_accuracy"] == 0.3 and s["target_accuracy_ci"] == [0.3, 0.3]
    assert s["target_fixed"] and s["target_rule"] == "first" and "first" in s["target_rules"]
    wide = s["arms"]["wide"]
    assert wide["differs"] == {"--batch-size": [128, 256], "--buffer-size": [128, 256],
                               "--prompts-per-round": [16, 32]}
    assert wide["vs_other"]["replay"]["differs"] == {"--batch-size": [128, 256],
                                                     "--buffer-size": [128, 256]}
    assert wide["discards_possible"] is False and "area_ci" in wide
    for path in (tmp_path / "rec").glob("*/seed*.json"):
        out = tmp_path / "out" / path.parent.name / path.name.split("-")[0]
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        assert records.read_rows(str(path)) == rows
    assert len(list((tmp_path / "rec").glob("*/seed*.metrics.jsonl.gz"))) == 9


ARM = ["--arms", "on_policy", "wide", "--arm", "wide"]


@pytest.mark.parametrize("argv, message", [
    (ARM + ["--buffer-size 16 --batch-size 16"], "--arm wide: give --prompts-per-round"),
    (ARM + [WIDE + " --seed 3"], "--arm wide: --seed is set by compare.py"),
    (ARM + [WIDE + " --no-such 1"], "unrecognized arguments: --no-such"),
    (["--arms", "on_policy", "wide"], "--arms wide: no such arm"),
    (["--arm", "wide", WIDE], "--arm wide: defined but not in --arms"),
    (["--pairs", "replay:wide"], "--pairs replay:wide: must be ARM:REFERENCE"),
    (["--target", "1.5"], "--target 1.5: an accuracy in (0, 1)"),
    (["--target", "0.4", "--target-frac", "0.5"], "--target 0.4 with --target-frac 0.5"),
])
def test_an_arm_pair_or_target_that_cannot_be_read_is_refused(tmp_path, capsys, compare_runs, argv,
                                                              message):
    assert message in refused(["--output-dir", str(tmp_path)] + argv, capsys, compare_runs)
