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
