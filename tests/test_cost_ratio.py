"""Issue 67, part 2: replay's compute against the cost ratio c (comparison/cost_ratio.py), on
made-up curves against hand-computed values, its GPU ratios against docs/gpu.md, and the committed
JSON as the script gives it today."""
import json
import math
import os
import statistics

import pytest

import cost_ratio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tokens, rounds, steps, B=16, seconds=(0.0, 0.0)):
    """A made-up run at the decisive grid that first reaches 0.45 at an eval (exactly there: no
    interpolation) after `tokens` generated tokens, `rounds` rounds of R = 4 and `steps` steps of
    B; seconds: its generation and training seconds over the whole run (its record)."""
    return {"accuracy": [0.15, 0.45, 0.5], "tokens": [0, tokens, 6400],
            "rounds": [0, rounds, 100], "steps": [0, steps, 50], "seconds": [0, 1, 2],
            "R": 4, "B": B,
            "record": {"config": {"seed": 0}, "evals": [{"round": 100, "gen_tokens": 6400}],
                       "last": {"round": 100, "gen_seconds": seconds[0],
                                "train_seconds": seconds[1]},
                       "rounds": {"generated": 400, "steps": 50}}}


def test_the_break_even_against_hand_computed_values():
    """Two seeds alike (sd 0: every interval is its point). Replay: 10 rounds (40 rollouts), 10
    steps of 16 (160 trained), 1,500 tokens; on-policy: 20 rounds (80), 5 steps (80), 2,000 tokens.
    Rollouts: 40 c + 160 against 80 c + 80, equal at c = 2; at c = 0: 2x, at infinity 0.5x.
    Tokens: 1,500 (c + 160/40) against 2,000 (c + 80/80), equal at c = 8; at infinity 0.75x."""
    curves = {"replay": {0: run(1500, 10, 10), 1: run(1500, 10, 10)},
              "on_policy": {0: run(2000, 20, 5), 1: run(2000, 20, 5)}}
    pp = cost_ratio.paired_parts(curves)
    assert pp[0] == ((40, 160, 1500), (80, 80, 2000))
    for basis, even, zero, infinity in (("rollouts", 2.0, 2.0, 0.5), ("tokens", 8.0, 3.0, 0.75)):
        assert cost_ratio.crossings(pp, basis, "mean") == [pytest.approx(even, rel=1e-9)]
        assert cost_ratio.crossings(pp, basis, "high_90") == [pytest.approx(even, rel=1e-9)]
        assert cost_ratio.at(pp, 0.0, basis)["ratio"] == pytest.approx(zero)
        assert cost_ratio.at(pp, math.inf, basis)["ratio"] == pytest.approx(infinity)
        assert [r["at_90"] for r in cost_ratio.ranges(pp, basis)] == ["replay costs more",
                                                                      "replay saves"]
    # c = 5: (200 + 160) / (400 + 80) = 0.75 on rollouts; 1,500 x 9 / (2,000 x 6) = 1.125 on tokens
    assert cost_ratio.at(pp, 5.0, "rollouts")["ratio"] == pytest.approx(0.75)
    assert cost_ratio.at(pp, 5.0, "tokens")["ratio"] == pytest.approx(1.125)


def test_the_interval_at_a_cost_ratio_against_hand_computed_values():
    """Three seeds at c = 1, rollouts: replay (40 + 160) against on-policy 80 + 80, 40 + 80 and
    120 + 80: log ratios log(200/160), log(200/120), log(200/200); the 90% interval mean -+
    t(0.95, 2) sd / sqrt 3, t(0.95, 2) = 2.919986; 95%: t(0.975, 2) = 4.302653. A control-sized
    B = 8 counts its steps at 8 rollouts each."""
    curves = {"replay": {s: run(1500, 10, 10) for s in range(3)},
              "on_policy": {0: run(2000, 20, 5), 1: run(2000, 10, 5), 2: run(2000, 30, 5)}}
    d = [math.log(200 / 160), math.log(200 / 120), 0.0]
    mean, sd = statistics.fmean(d), statistics.stdev(d)
    got = cost_ratio.at(cost_ratio.paired_parts(curves), 1.0, "rollouts")
    assert got["ratio"] == pytest.approx(math.exp(mean))
    for key, t in (("ratio_90", 2.919986), ("ratio_95", 4.302653)):
        half = t * sd / math.sqrt(3)
        assert got[key] == pytest.approx([math.exp(mean - half), math.exp(mean + half)], rel=1e-5)
    assert cost_ratio.parts(run(1500, 10, 10, B=8)) == (40, 80, 1500)


def test_a_run_that_never_reaches_counts_at_the_budget():
    never = {**run(1500, 10, 10), "accuracy": [0.15, 0.3, 0.4]}
    assert cost_ratio.parts(never) == (400, 800, 6400)        # its last eval: 100 rounds, 50 steps


def test_the_cpu_ratio_against_hand_computed_values():
    """Two on-policy runs of 100 rounds (400 rollouts), 6,400 tokens. A: 10 s generating, 20 s
    training 50 steps of 16 (800); B: 30 s and 20 s, 25 steps (400: trained tokens 6,400 x 400 /
    400). Rollouts: (40 / 800) / (40 / 1,200) = 1.5. Tokens: (40 / 12,800) / (40 / (12,800 +
    6,400)) = 1.5 as well here: every run generates the same tokens per rollout; B 3,200 tokens:
    (40 / 9,600) / (40 / (12,800 + 3,200)) = 5 / 3."""
    a, b = run(1, 1, 1, seconds=(10.0, 20.0)), run(1, 1, 1, seconds=(30.0, 20.0))
    b["record"]["rounds"]["steps"] = 25
    curves = {"on_policy": {0: a, 1: b}}
    assert cost_ratio.cpu_ratio(curves, "rollouts") == pytest.approx(1.5)
    assert cost_ratio.cpu_ratio(curves, "tokens") == pytest.approx(1.5)
    b["record"]["evals"][-1]["gen_tokens"] = 3200
    assert cost_ratio.cpu_ratio(curves, "tokens") == pytest.approx(5 / 3)
    import compare_decisive                 # the rollouts basis is compare_decisive's measured mu
    assert compare_decisive.measured_mu(curves) == pytest.approx(cost_ratio.cpu_ratio(curves,
                                                                                      "rollouts"))


def test_the_gpu_ratios_are_docs_gpu_md_s():
    """docs/gpu.md's round with the fast path (1,461 ms generating 64 rollouts, 229 ms training
    one step on 64: gpu_check.sh runs bench.py with 8 prompts x 8 and B = 64), its tokens per second
    (the same ratio per token), and its shares without the fast path (90-96%: c >= f / (1 - f))."""
    gpu = open(os.path.join(ROOT, "docs", "gpu.md")).read()
    row = "| a round of the loop with it: generation / training | 1,461 ms (86%) / 229 ms (14%) |"
    assert row in gpu
    assert "generation was 90-96% of a round" in gpu
    assert "| tokens per second: sampled / trained | 5,605 / 35,762 |" in gpu
    check = open(os.path.join(ROOT, "benchmarks", "gpu_check.sh")).read()
    assert "--prompts 8 --num-generations 8 --batch-size 64 --buffer-size 64" in check
    g = cost_ratio.gpu_ratios()
    assert g["gpu_fast"] == pytest.approx(1461 / 229) == pytest.approx(35762 / 5605, abs=0.01)
    assert (g["gpu_plain_low"], g["gpu_plain_high"]) == (pytest.approx(9.0), pytest.approx(24.0))


def test_the_committed_json_is_what_the_script_gives(tmp_path):
    path = os.path.join(ROOT, "docs", "results", "smollm2_decisive_cost_ratio.json")
    committed = json.load(open(path))
    again = cost_ratio.main(["--output", str(tmp_path / "c.json")])
    assert json.loads(json.dumps(again)) == committed
    assert os.path.exists(tmp_path / "c.png")
    decisive = json.load(open(os.path.join(ROOT, "docs", "results", "smollm2_decisive.json")))
    pair = decisive["pairs"]["replay/on_policy"]
    rollouts = committed["bases"]["rollouts"]
    # the measured CPU ratio and the compute at it are the decisive verdict's
    assert rollouts["marked"]["cpu"]["c"] == pytest.approx(pair["mu"]["measured"])
    fig = pair["log_compute_ratio"]["measured"]
    assert rollouts["marked"]["cpu"]["ratio"] == pytest.approx(math.exp(fig["mean"]))
    assert rollouts["marked"]["cpu"]["ratio_90"] == pytest.approx(
        [math.exp(x) for x in fig["interval_90"]])
    # as c grows, rollouts generated; on tokens, the primary figure
    assert rollouts["at_infinity"]["ratio"] == pytest.approx(
        math.exp(pair["log_round_ratio"]["mean"]))
    assert committed["bases"]["tokens"]["at_infinity"]["ratio_90"] == pytest.approx(
        pair["token_ratio_90"])


def test_the_end_of_run_summary_says_where_the_runs_cost_ratio_stands(capsys):
    """train.py's end summary (infra/report.summary) prints the run's cost ratio, generation seconds
    per rollout generated over training seconds per rollout trained, and where it stands against the
    break-even; report.py's figures are the committed JSON's (rollouts basis, rounded)."""
    import train
    from infra import report
    from infra.checkpoint import LoopState
    committed = json.load(open(os.path.join(ROOT, "docs", "results",
                                            "smollm2_both_cost_ratio.json")))
    b = committed["bases"]["rollouts"]
    assert [round(x, 1) for x in b["break_even"]] == [report.BREAK_EVEN]
    assert [round(x, 1) for x in b["crossings"]["low_90"]] == [report.COSTS_MORE_BELOW]
    assert [round(x) for x in b["crossings"]["high_90"]] == [report.SAVES_ABOVE]
    assert len(committed["seeds"]) == 28
    # 15 s generating 100 rollouts, 20 s training on 200: (15 / 100) / (20 / 200) = 1.5
    for gen, where in ((15.0, "below"), (80.0, "above")):
        state = LoopState(first_accuracy=0.3, last_accuracy=0.5, gen_seconds=gen,
                          train_seconds=20.0, rollouts_generated=100, rollouts_trained=200)
        report.summary(train.Config(), state, "runs/x")
        out = capsys.readouterr().out
        assert f"generation/training cost ratio {gen / 10:.2f}: seconds to generate one" in out
        assert (f"replay (y = 2) broke even with on-policy at a cost ratio of 3.4 on SmolLM2-135M"
                in out and "(the mean of 28 seeds; replay cost more below 1.3 and cost less above 19, "
                "at 90%)" in out and f"not of this run, whose ratio is {where} it" in out)


def test_fewer_than_two_paired_seeds_is_refused_in_one_line(monkeypatch, capsys):
    """The confirmatory records arrive one by one: with fewer than 2 seeds in both arms the script
    says so instead of failing inside the statistics."""
    monkeypatch.setattr(cost_ratio, "load", lambda comparison: {"replay": {}, "on_policy": {
        200: run(2000, 20, 5)}})
    with pytest.raises(SystemExit):
        cost_ratio.main(["--comparison", "confirmatory", "--output", "-"])
    assert "fewer than 2 seeds with both arms' records" in capsys.readouterr().err


def test_the_sign_flip_test_is_left_out_only_past_max_flipped_seeds():
    """--comparison both pairs 28 seeds: 2^28 sign flips would take hours, so past MAX_FLIPPED
    the exact sign-flip p is left out (None); the t figures are the same either way."""
    import compare_decisive as decisive
    d = [-0.3, 0.1, -0.2, -0.05, 0.02]      # sum -0.43; |d| sums to 0.67
    full, lean = decisive.paired_test(d), decisive.paired_test(d, permutation=False)
    # a flip's sum is 2 x (its plus side) - 0.67, at most -0.43 for a plus side of at most 0.12:
    # none, 0.02, 0.05, 0.1, 0.05 + 0.02, 0.1 + 0.02: 6 of the 32
    assert lean["p_permutation"] is None and full["p_permutation"] == pytest.approx(6 / 32)
    assert {k: v for k, v in lean.items() if k != "p_permutation"} == \
        {k: v for k, v in full.items() if k != "p_permutation"}
    assert cost_ratio.MAX_FLIPPED < 28


@pytest.mark.parametrize("comparison, seeds", [("confirmatory", 18), ("both", 28)])
def test_the_confirmatory_and_pooled_jsons_are_what_the_script_gives(comparison, seeds, tmp_path):
    path = os.path.join(ROOT, "docs", "results", f"smollm2_{comparison}_cost_ratio.json")
    committed = json.load(open(path))
    again = cost_ratio.main(["--comparison", comparison, "--output", str(tmp_path / "c.json")])
    assert json.loads(json.dumps(again)) == committed
    assert len(committed["seeds"]) == seeds
    marked = committed["bases"]["rollouts"]["marked"]["cpu"]["log_compute_ratio"]
    assert (marked["p_permutation"] is None) == (seeds > cost_ratio.MAX_FLIPPED)
