"""The pre-registered comparisons of issue 59 (docs/plans/): their tests computed against values
worked out by hand, their verdict rules on made-up patterns, and their commands as the plans state."""
import math

import pytest

import compare
import compare_collapse
import compare_decisive


def test_the_paired_test_against_hand_computed_values():
    """d = -1, -2, -3: mean -2, sd 1, t = -2 / (1 / sqrt 3) = -3.464 on 2 degrees of freedom, whose
    CDF is 1/2 + t / (2 sqrt(2 + t^2)): p = 0.0371; of the 8 sign flips only all-negative sums to
    -6 or less: 1/8; the 90% interval -2 -+ 2.920 / sqrt 3."""
    r = compare_decisive.paired_test([-1.0, -2.0, -3.0])
    t = -2 * math.sqrt(3)
    assert r["mean"] == -2 and r["sd"] == pytest.approx(1.0) and r["t"] == pytest.approx(t)
    assert r["p_t"] == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-9)
    assert r["p_t"] == pytest.approx(0.0371, abs=1e-4)
    assert r["p_permutation"] == 1 / 8
    assert r["interval_90"] == pytest.approx([-2 - 2.919986 / math.sqrt(3), -2 + 2.919986 / math.sqrt(3)],
                                             abs=1e-5)
    flat = compare_decisive.paired_test([0.5, -0.5, 0.5, -0.5])
    assert flat["p_permutation"] == pytest.approx(11 / 16) and flat["p_t"] == pytest.approx(0.5)


def test_a_seed_that_never_reaches_counts_at_the_budget():
    curve = {"accuracy": [0.1, 0.3, 0.5], "tokens": [0, 800, 1600], "rounds": [0, 10, 20],
             "steps": [0, 2, 5], "seconds": [0, 1, 2]}
    reach = compare_decisive.first_reach(curve)           # 0.45 is 3/4 of the way from 0.3 to 0.5
    assert reach == {"tokens": 1400.0, "rounds": 17.5, "steps": 4.25, "reached": True}
    never = compare_decisive.first_reach({**curve, "accuracy": [0.1, 0.2, 0.3]})
    assert never == {"tokens": float(compare_decisive.BUDGET), "rounds": 20, "steps": 5,
                     "reached": False}
    # compute in training-rollout units: 17.5 rounds x 4 rollouts x mu 5 + 4.25 steps x B 16
    assert compare_decisive.compute_to_target(reach, "replay", 5.0) == 17.5 * 4 * 5 + 4.25 * 16
    assert compare_decisive.compute_to_target(reach, "control", 5.0) == 17.5 * 4 * 5 + 4.25 * 8


def figure(collapsed):
    return {"collapsed": collapsed}


@pytest.mark.parametrize("pattern, says, loss", [
    ({"reuse_fresh": 2, "stale_once": 0, "sampler_tis": 3, "sampler_ppo": 0},
     "(reuse), not staleness", "ppo"),
    ({"reuse_fresh": 0, "stale_once": 3, "sampler_tis": 2, "sampler_ppo": 3},
     "staleness bias, not reuse", "ppo"),
    ({"reuse_fresh": 1, "stale_once": 1, "sampler_tis": 2, "sampler_ppo": 2},
     "the two together", "ppo"),
    ({"reuse_fresh": 0, "stale_once": 0, "sampler_tis": 1, "sampler_ppo": 3},
     "does not reproduce the collapse", "tis"),
])
def test_the_collapse_verdict_follows_its_rule(pattern, says, loss):
    fig = {"on_policy": [figure(False)] * 3}
    fig.update({arm: [figure(i < n) for i in range(3)] for arm, n in pattern.items()})
    lines = compare_collapse.verdict(fig)
    assert says in " ".join(lines) and lines[-1].endswith(f"--loss {loss}, lr 2.5e-4")


def test_the_plans_commands_parse_and_differ_only_where_the_plans_say():
    for argv in (compare_collapse.compare_argv(), compare_decisive.compare_argv()):
        compare.parse(argv)                                  # compare.py takes them as they are
    decisive = compare.parse(compare_decisive.compare_argv())
    assert decisive.first_seed == 100 and decisive.seeds == 6 and decisive.budget_tokens == 6400
    assert dict(decisive.arm)["replay"].endswith(f"--loss {compare_decisive.LOSS}")
    assert compare.parse(compare_decisive.compare_argv(10)).seeds == 10


def test_the_fair_demo_gives_the_synchronous_arm_the_async_arms_cores_and_keeps_the_sampler():
    """compare_async.py demo_fair: "demo" with --threads 2 (the synchronous run on as many threads as
    an async run has processes) and the sampler uncapped, as first measured; nothing else differs."""
    import compare_async
    old, fair = compare_async.compare_argv("demo"), compare_async.compare_argv("demo_fair")
    args = compare.parse(fair)
    assert args.threads == 2 and compare.parse(old).threads == 1
    arms_old, arms_fair = dict(compare.parse(old).arm), dict(args.arm)
    assert arms_fair["async_replay"] == arms_old["async_replay"] + " --max-uses 0"
    assert {k: v for k, v in arms_fair.items() if k != "async_replay"} == \
        {k: v for k, v in arms_old.items() if k != "async_replay"}
    assert args.records.endswith("async_demo_fair") and args.output_dir.endswith("async_demo_fair")


def wall_curve(accuracy, seconds, cpu=1.8):
    """A made-up async run at the decisive grid: its evals' accuracy and wall seconds, its last
    eval's CPU seconds cpu x wall."""
    n = len(accuracy)
    last = {"wall_seconds": seconds[-1], "gen_cpu_seconds": cpu * seconds[-1] / 2,
            "train_cpu_seconds": cpu * seconds[-1] / 2}
    return {"accuracy": accuracy, "seconds": seconds, "tokens": [800 * i for i in range(n)],
            "rounds": [10 * i for i in range(n)], "steps": [2 * i for i in range(n)],
            "record": {"evals": [last]}}


def test_the_wall_clock_verdict_against_hand_computed_values():
    """Seed 0: replay reaches 0.45 half way from 0.4 to 0.5 between 100 s and 200 s (150 s),
    on-policy at its 300 s eval: log(150 / 300). Seed 1: replay never reaches (its last eval, 400 s),
    on-policy at 200 s: log(2). Seed 2: both at their second eval, 100 s and 100 s: 0."""
    flat, slow = [0.1, 0.2, 0.3], [0.1, 0.45, 0.6]
    replay = {0: wall_curve([0.1, 0.4, 0.5], [0, 100, 200]), 1: wall_curve(flat, [0, 200, 400]),
              2: wall_curve(slow, [0, 100, 200])}
    on = {0: wall_curve([0.1, 0.3, 0.45], [0, 150, 300]), 1: wall_curve(slow, [0, 200, 300], 1.0),
          2: wall_curve(slow, [0, 100, 150])}
    out = compare_decisive.wall_verdict({"on_policy": on, "async_replay": replay})
    assert out["seeds"] == [0, 1, 2] and out["reached"] == {"on_policy": 3, "async_replay": 2}
    assert out["seconds_to_first_reach"] == {"on_policy": [300, 200, 100],
                                             "async_replay": [150, 400, 100]}
    d = [math.log(0.5), math.log(2), 0.0]
    pair = out["async_replay/on_policy"]
    assert pair["log_seconds_ratio"]["values"] == pytest.approx(d)
    assert pair["seconds_ratio"] == pytest.approx(1.0) and not pair["saving_detected"]
    assert out["cpu_per_wall"]["on_policy"] == pytest.approx([1.8, 1.0, 1.8])


def test_the_wall_clock_pair_is_the_decisive_arms_with_one_worker_and_refuses_busy_cores(monkeypatch):
    """Each async arm's flags are its synchronous arm's plus --generators 1; one run at a time, one
    thread a process; on busy cores it refuses before any run."""
    argv = compare_decisive.compare_argv(6, compare_decisive.WALL_ARMS, compare_decisive.WALL_RECORDS,
                                         "runs/w", jobs=1)
    args = compare.parse(argv)
    arms, sync = dict(args.arm), dict(compare.parse(compare_decisive.compare_argv()).arm)
    assert arms["on_policy"].replace("--generators 1 ", "") == sync["on_policy"]
    assert arms["async_replay"].replace("--generators 1 ", "") == sync["replay"]
    assert args.jobs == 1 and args.threads == 1 and args.seeds == 6 and args.first_seed == 100
    ran = []
    monkeypatch.setattr(compare, "main", lambda argv: ran.append(argv))
    monkeypatch.setattr(compare_decisive, "busy_share", lambda: 0.6)
    with pytest.raises(SystemExit):
        compare_decisive.main(["--wall-clock"])
    monkeypatch.setattr(compare_decisive, "busy_share", lambda: 0.05)
    compare_decisive.main(["--wall-clock"])
    assert ran == [argv[:-1] + ["runs/smollm2_decisive_wall"]]


def test_the_looks_alpha_follows_the_plan():
    """6 seeds at sd <= 0.34: one look at 0.05; above it, and at the 10-seed look, 0.025."""
    assert compare_decisive.look_alpha(6, 0.34) == 0.05
    assert compare_decisive.look_alpha(6, 0.41) == 0.025
    assert compare_decisive.look_alpha(10, 0.41) == 0.025 == compare_decisive.look_alpha(10, 0.2)


def test_the_paired_tests_95_interval_against_hand_computed_values():
    """d = -1, -2, -3: t(0.975, 2) = 4.302653: -2 -+ 4.302653 / sqrt 3."""
    r = compare_decisive.paired_test([-1.0, -2.0, -3.0])
    assert r["interval_95"] == pytest.approx([-2 - 4.302653 / math.sqrt(3), -2 + 4.302653 / math.sqrt(3)],
                                             abs=1e-5)


# ---- the confirmatory comparison (issue 67): its verdict on made-up curves -----------------------
def reaching(tokens):
    """A made-up run that first reaches 0.45 at an eval at exactly `tokens` (no interpolation: the
    eval is at the target); None: one that never reaches it within the budget."""
    if tokens is None:
        return {"accuracy": [0.15, 0.3, 0.4], "tokens": [0, 3200, 6400], "rounds": [0, 40, 80],
                "steps": [0, 10, 20], "seconds": [0, 1, 2]}
    return {"accuracy": [0.15, 0.45, 0.5], "tokens": [0, tokens, 6400], "rounds": [0, 10, 80],
            "steps": [0, 2, 20], "seconds": [0, 1, 2]}


def confirm_curves(on_policy, replay):
    return {"on_policy": {200 + i: reaching(t) for i, t in enumerate(on_policy)},
            "replay": {200 + i: reaching(t) for i, t in enumerate(replay)}}


def by_hand(d):
    """mean, sd and the 90% t-interval of d, t(0.95, 4) = 2.131847 (the tables), for 5 seeds."""
    import statistics
    mean, sd = statistics.fmean(d), statistics.stdev(d)
    half = 2.131847 * sd / math.sqrt(5)
    return mean, sd, (mean - half, mean + half)


@pytest.mark.parametrize("d, detected, excluded, words", [
    # mean -0.5, sd 0.158: t -7.07 < -2.13; of the 32 sign flips only all-negative sums as low
    ([-0.3, -0.4, -0.5, -0.6, -0.7], True, False, "a saving detected"),
    # mean -0.1, sd 0.0158: the interval [-0.115, -0.085], its low end above log 0.75 = -0.288
    ([-0.08, -0.09, -0.10, -0.11, -0.12], True, True,
     "a saving detected, and a 25% saving excluded"),
    # mean 0, sd 0.079: [-0.075, +0.075]; p_t 0.5
    ([0.1, -0.1, 0.05, -0.05, 0.0], False, True, "a 25% saving excluded (no saving detected)"),
    # mean -0.14, sd 0.77: [-0.87, +0.59]
    ([-0.9, 0.8, -0.7, 0.6, -0.5], False, False,
     "neither a saving detected nor a 25% saving excluded"),
])
def test_the_confirmatory_verdict_against_hand_computed_values(d, detected, excluded, words):
    """On-policy first reaches 0.45 at 2,000 tokens in every seed, replay at 2,000 e^d_i: the log
    ratios are d; the verdict is the plan's (both p below 0.05; the 90% low end above log 0.75)."""
    import compare_confirm
    out = compare_confirm.verdict(confirm_curves([2000] * 5, [2000 * math.exp(x) for x in d]))
    mean, sd, (lo, hi) = by_hand(d)
    p = out["primary"]
    assert p["log_token_ratio"]["values"] == pytest.approx(d)
    assert p["log_token_ratio"]["mean"] == pytest.approx(mean)
    assert p["log_token_ratio"]["sd"] == pytest.approx(sd)
    assert p["token_ratio_90"] == pytest.approx([math.exp(lo), math.exp(hi)], rel=1e-5)
    assert (p["saving_detected"], p["saving_of_25pct_excluded"]) == (detected, excluded)
    assert p["verdict"] == words
    if detected:            # every d negative: of the 32 sign flips only d itself sums as low
        assert p["log_token_ratio"]["p_permutation"] == 1 / 32
    assert out["reached"] == {"on_policy": 5, "replay": 5} and not out["complete"]
    assert out["seeds"] == [200, 201, 202, 203, 204] and out["alpha"] == 0.05
    # no run failed to reach: the sensitivity line is the primary one
    assert out["sensitivity"]["log_token_ratio"]["values"] == pytest.approx(d)
    assert out["sensitivity"]["same_verdict"]
    if not detected:        # the seeds a 90%-power test at 0.05 needs at this sd for a 25% saving
        import power
        k = p["seeds_for_90pct_power"]
        effect = -math.log(0.75) / sd
        assert power.exact_power(k - 1, effect) < 0.9 <= power.exact_power(k, effect)


def test_the_sensitivity_line_counts_non_reaching_runs_at_12800_tokens():
    """Seeds 200-204: on-policy at 2,000 tokens in four seeds and never in 204; replay at 2,000
    e^{-0.1, -0.1, 0.1, 0.1} and at 3,200 in 204. Primary: 204's log ratio log(3200 / 6400) =
    log 0.5; the others' mean 0: mean log(0.5) / 5 = -0.139, and the 25% saving is neither detected
    nor excluded. Sensitivity, 204 at 12,800: log 0.25, mean -0.277; the verdict the same words."""
    import compare_confirm
    out = compare_confirm.verdict(confirm_curves([2000] * 4 + [None],
                                                 [2000 * math.exp(x) for x in (-.1, -.1, .1, .1)]
                                                 + [3200]))
    assert out["reached"] == {"on_policy": 4, "replay": 5}
    primary, sens = out["primary"], out["sensitivity"]
    d = [-0.1, -0.1, 0.1, 0.1]
    assert primary["log_token_ratio"]["values"] == pytest.approx(d + [math.log(0.5)])
    assert sens["log_token_ratio"]["values"] == pytest.approx(d + [math.log(0.25)])
    assert sens["non_reaching_at_tokens"] == 12800
    for line, last in ((primary, math.log(0.5)), (sens, math.log(0.25))):
        mean, sd, (lo, hi) = by_hand(d + [last])
        assert line["log_token_ratio"]["mean"] == pytest.approx(mean)
        assert line["token_ratio_90"] == pytest.approx([math.exp(lo), math.exp(hi)], rel=1e-5)
        assert not line["saving_detected"] and not line["saving_of_25pct_excluded"]
    assert sens["same_verdict"]
    assert out["mean_tokens_to_first_reach"]["on_policy"] == pytest.approx((4 * 2000 + 6400) / 5)


def test_the_sensitivity_line_can_change_the_verdict():
    """Seeds 200-204: on-policy never reaches in 200 and 201, reaches at 2,000 in the rest; replay
    at 6,000 in 200 and 201 and at 2,000 in the rest. Primary: d = log(6000 / 6400) twice and 0
    three times: mean -0.0258, sd 0.0353, the 90% interval [-0.0595, +0.0079]: a 25% saving
    excluded, none detected. At 12,800 tokens: log(6000 / 12800) = -0.758 twice: mean -0.303,
    sd 0.415, the interval [-0.699, +0.093]: neither."""
    import compare_confirm
    out = compare_confirm.verdict(confirm_curves([None, None, 2000, 2000, 2000],
                                                 [6000, 6000, 2000, 2000, 2000]))
    for line, never in ((out["primary"], 6400), (out["sensitivity"], 12800)):
        d = [math.log(6000 / never)] * 2 + [0.0] * 3
        mean, sd, (lo, hi) = by_hand(d)
        assert line["log_token_ratio"]["values"] == pytest.approx(d)
        assert line["token_ratio_90"] == pytest.approx([math.exp(lo), math.exp(hi)], rel=1e-5)
    assert out["primary"]["verdict"] == "a 25% saving excluded (no saving detected)"
    assert out["sensitivity"]["verdict"] == "neither a saving detected nor a 25% saving excluded"
    assert not out["sensitivity"]["same_verdict"]
    assert out["primary"]["token_ratio_90"][0] == pytest.approx(math.exp(-0.0595), abs=1e-3)
    assert out["sensitivity"]["token_ratio_90"] == pytest.approx(
        [math.exp(-0.699), math.exp(0.093)], abs=2e-3)


def test_the_confirmatory_plan_has_fresh_seeds_and_18_of_them():
    import compare_confirm
    args = compare.parse(compare_confirm.compare_argv())
    assert args.first_seed == 200 and args.seeds == 18 and args.budget_tokens == 6400
    assert set(dict(args.arm)) == {"on_policy", "replay"}
    assert compare_confirm.seeds_needed() == 18 and compare_confirm.seeds_needed(alpha=0.025) == 23


@pytest.mark.slow
def test_the_decisive_verdict_and_checks_jsons_are_what_the_records_give(capsys):
    """docs/results/smollm2_decisive.json (--verdict) and smollm2_decisive_checks.json (--checks,
    issue 67's readings) as compare_decisive.py computes them from the committed records today."""
    import json
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for flag, name in (("--verdict", "smollm2_decisive.json"),
                       ("--checks", "smollm2_decisive_checks.json")):
        again = compare_decisive.main([flag])
        committed = json.load(open(os.path.join(root, "docs", "results", name)))
        assert json.loads(json.dumps(again, default=lambda x: None)) == committed, name
    capsys.readouterr()


@pytest.mark.slow
def test_the_confirmatory_verdict_json_is_what_its_records_give(capsys):
    """docs/results/smollm2_confirmatory.json as compare_confirm.py --verdict computes it from the
    36 committed records today: every planned seed, one of the plan's verdicts."""
    import json
    import os
    import compare_confirm
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    again = compare_confirm.main(["--verdict"])
    capsys.readouterr()
    committed = json.load(open(os.path.join(root, "docs", "results", "smollm2_confirmatory.json")))
    assert json.loads(json.dumps(again, default=lambda x: None)) == committed
    assert committed["complete"] and committed["seeds"] == committed["planned_seeds"]
    assert committed["seeds"] == list(range(200, 218))
    assert committed["primary"]["verdict"] in (
        "a saving detected", "a saving detected, and a 25% saving excluded",
        "a 25% saving excluded (no saving detected)",
        "neither a saving detected nor a 25% saving excluded")
    assert committed["primary"]["log_token_ratio"]["n"] == 18
