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


def test_reach_needs_the_target_held_not_one_lucky_eval():
    target = 0.464
    # a lucky last eval: the median of the last three is 0.40
    assert compare.reach_index([0.30, 0.40, 0.40, 0.40, 0.40, 0.47], target) is None
    # a lucky early eval, everything after it below
    assert compare.reach_index([0.30, 0.60, 0.40, 0.40, 0.30, 0.30], target) is None
    # held from index 3 (its neighbourhood 0.47, 0.30, 0.50 has median 0.47: the 0.30 is the outlier);
    # index 2's neighbourhood 0.40, 0.47, 0.30 has median 0.40
    assert compare.reach_index([0.30, 0.40, 0.47, 0.30, 0.50, 0.48, 0.47], target) == 3
    assert compare.reach_index([0.1, 0.2, 0.5, 0.5, 0.5, 0.5], 0.5) == 2
    # reached, then lost: not held, so not reached
    assert compare.reach_index([0.1, 0.5, 0.5, 0.5, 0.2, 0.2], 0.5) is None
    # a curve always reaches its own final accuracy (the median of its last three evals)
    for accs in ([0.1, 0.3, 0.2, 0.5, 0.4, 0.45], [0.5, 0.4, 0.3, 0.2, 0.1, 0.05], [0.2, 0.2, 0.2]):
        assert compare.reach_index(accs, compare.final_accuracy(accs)) is not None


def run_of(accs, generated, trained, tokens=None, entropy=0.5):
    n = len(accs)
    return {"accuracy": accs, "generated": generated, "trained": trained,
            "tokens": tokens or [10 * g for g in generated], "seconds": [float(g + t) for g, t in zip(generated, trained)],
            "entropy": entropy}


def test_compare_arm_uses_exact_counts_and_projects_by_hand():
    grid = [0, 1, 2, 3, 4, 5]
    on = [run_of([0.1, 0.2, 0.3, 0.4, 0.5, 0.5], [100 * k for k in grid], [100 * k for k in grid], entropy=0.6)]
    # reaches the on-policy target (0.5) at index 2 instead of 4, with half the rollouts generated per eval
    # and the same number trained
    rep = [run_of([0.1, 0.3, 0.5, 0.5, 0.5, 0.5], [50 * k for k in grid], [100 * k for k in grid], entropy=0.5)]
    fig = compare.compare_arm(rep, on, [1.0, 8.0])
    # to the target: on-policy 400 generated + 400 trained, replay 100 generated + 200 trained
    assert fig["token_ratio"] == pytest.approx(100 / 400)
    assert fig["projected"][8.0] == pytest.approx((8 * 100 + 200) / (8 * 400 + 400))
    assert fig["projected"][1.0] == pytest.approx((100 + 200) / (400 + 400))
    assert fig["accuracy_diff"] == pytest.approx(0.0) and fig["entropy_diff"] == pytest.approx(-0.1)
    never = [run_of([0.1] * 6, [50 * k for k in grid], [100 * k for k in grid])]
    assert compare.compare_arm(never, on, [8.0])["token_ratio"] == float("inf")


def test_bootstrap_interval_covers_the_spread_of_seeds_and_is_exact_without_spread():
    grid = [0, 1, 2, 3, 4, 5]
    on = [run_of([0.1, 0.2, 0.3, 0.4, 0.5, 0.5], [100 * k for k in grid], [100 * k for k in grid])] * 3
    rep = [run_of([0.1, 0.3, 0.5, 0.5, 0.5, 0.5], [50 * k for k in grid], [100 * k for k in grid])] * 3
    ci = compare.bootstrap(rep, on, [8.0], n=200)
    assert ci["token_ratio"] == [pytest.approx(0.25), pytest.approx(0.25)] and ci["not_reached_frac"] == 0
    noisy = [run_of([0.1, 0.1 + d, 0.5 + d, 0.5 + d, 0.5 + d, 0.5 + d], [50 * k for k in grid],
                    [100 * k for k in grid]) for d in (-0.2, 0.0, 0.1)]
    ci = compare.bootstrap(noisy, on, [8.0], n=400)
    lo, hi = ci["accuracy_diff"]
    assert -0.2 <= lo < 0 < hi <= 0.1 + 1e-9                 # within noise: the interval spans 0
    assert 0 < ci["not_reached_frac"] < 1                    # resamples of the -0.2 seed alone never reach
    assert compare.verdict([0.4, 0.9], [-0.01, 0.02]) == "fewer tokens; final accuracy within noise"
    assert compare.verdict([0.8, 1.3], [0.01, 0.02]) == "tokens within noise; higher final accuracy"


def test_arms_follow_their_definitions():
    def parse(flags):
        return {flags[i]: flags[i + 1] for i in range(0, 6, 2)}
    on, rep, ctl = (parse(compare.arm_flags(a, 256, 2, 8, 0.3)) for a in ("on_policy", "replay", "control"))
    # on-policy: R = B = N; replay: R = B/y, N = B (each rollout used y times); control: R = B = N = B/y
    assert (int(on["--prompts-per-round"]) * 8, int(on["--buffer-size"]), int(on["--batch-size"])) == (256, 256, 256)
    assert (int(rep["--prompts-per-round"]) * 8, int(rep["--buffer-size"]), int(rep["--batch-size"])) == (128, 256, 256)
    assert (int(ctl["--prompts-per-round"]) * 8, int(ctl["--buffer-size"]), int(ctl["--batch-size"])) == (128, 128, 128)
    assert compare.arm_flags("replay_pbr", 256, 2, 8, 0.3)[-2:] == ["--keep-correct-frac", "0.3"]
    for arm, cap in (("replay_cap1", 1.0), ("replay_cap4", 4.0)):   # the replay arm, another cap C
        flags = compare.arm_flags(arm, 256, 2, 8, 0.3)
        assert flags == compare.arm_flags("replay", 256, 2, 8, 0.3) + ["--is-cap", str(cap)]
    y3 = parse(compare.arm_flags("replay_y3", 240, 2, 8, 0.3))     # each rollout used 3 times: R = B/3
    assert (int(y3["--prompts-per-round"]) * 8, int(y3["--buffer-size"]), int(y3["--batch-size"])) == (80, 240, 240)
    cn = compare.arm_flags("control_nonzero", 256, 2, 8, 0.3)
    # filtered on-policy: R = B/y per round, each kept rollout used once, N leaves room for a round's leftovers
    assert parse(cn) == {"--prompts-per-round": "16", "--buffer-size": "384", "--batch-size": "256"}
    assert cn[-2:] == ["--skip-zero-advantage", "--no-reuse"]


def test_quick_comparison_writes_the_summary_and_the_plot(tmp_path, tiny_path):
    # two arms (each run is a process of its own: the suite's slowest test); the control's flags are
    # checked in test_arms_follow_their_definitions
    summary = compare.main(["--quick", "--output-dir", str(tmp_path), "--arms", "on_policy", "replay"])
    on_disk = json.load(open(tmp_path / "summary.json"))
    assert on_disk["target_accuracy"] == summary["target_accuracy"]
    assert set(on_disk["arms"]) == {"on_policy", "replay"}
    finals = []
    for name, arm in on_disk["arms"].items():
        assert isinstance(arm["final_accuracy"], float) and 0 <= arm["final_accuracy"] <= 1
        assert arm["seeds"] == 2 and isinstance(arm["entropy"], float) and arm["entropy"] > 0
        for key in ("tokens_to_target", "seconds_to_target"):
            assert arm[key] is None or arm[key] > 0
        for seed in range(2):
            rows = [json.loads(l) for l in open(tmp_path / name / f"seed{seed}" / "metrics.jsonl")]
            assert rows[-1]["gen_tokens"] >= on_disk["budget_tokens"] == 5_000     # one budget for every run
            if name == "on_policy":
                finals.append(compare.read_run(str(tmp_path / name / f"seed{seed}"), on_disk["grid_tokens"])["accuracy"])
    assert on_disk["target_accuracy"] == pytest.approx(compare.final_accuracy(
        [sum(x) / 2 for x in zip(*finals)]))                                 # the mean curve's last three
    assert on_disk["arms"]["on_policy"]["tokens_to_target"] is not None
    for name in ("replay",):
        arm = on_disk["arms"][name]
        lo, hi = arm["accuracy_diff_ci"]
        assert lo <= hi and set(arm["projected_time_ratio"]) == {f"{m:g}" for m in on_disk["projected_at_mu"]}
        assert on_disk["projected_at_mu"][1:] == [8.0, 27.0] and arm["verdict"]
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_missing_matplotlib_is_a_message_not_a_crash(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # import matplotlib -> ImportError
    compare.plot({"arms": {}, "target_accuracy": 0.5}, str(tmp_path / "curves.png"))
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "curves.png").exists()


def test_bootstrap_draws_an_arm_and_on_policy_replicate_together():
    """Replicate i of every arm starts from model i. Here model 0 learns fast and model 1 slowly,
    under both arms, and replay needs half the tokens on each: drawn in pairs, every resample says
    0.5; drawn apart, a fast on-policy run could meet a slow replay run."""
    grid = [0, 1, 2, 3, 4, 5, 6, 7]
    fast = [0.1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    slow = [0.1, 0.1, 0.1, 0.5, 0.5, 0.5, 0.5, 0.5]
    on = [run_of(fast, [100 * k for k in grid], [100 * k for k in grid]),
          run_of(slow, [100 * k for k in grid], [100 * k for k in grid])]
    rep = [run_of(fast, [50 * k for k in grid], [100 * k for k in grid]),
           run_of(slow, [50 * k for k in grid], [100 * k for k in grid])]
    ci = compare.bootstrap(rep, on, [8.0], n=300)
    assert ci["token_ratio"] == [pytest.approx(0.5), pytest.approx(0.5)]


def test_lr_choice_is_the_best_mean_over_replicates_and_flags_the_edge():
    best, means, edge = compare.choose_lr({1e-3: [0.6, 0.8], 3e-3: [0.9, 0.3], 3e-4: [0.5, 0.5]})
    assert best == 1e-3 and means == {3e-4: 0.5, 1e-3: pytest.approx(0.7), 3e-3: pytest.approx(0.6)} and not edge
    assert compare.choose_lr({1e-3: [0.7], 3e-3: [0.7]})[0] == 1e-3            # a tie: the smaller lr
    assert compare.choose_lr({1e-3: [0.6], 3e-3: [0.7], 3e-4: [0.1]})[2]        # best on the edge: widen the grid
    assert compare.sweep_score({"accuracy": [0.2, 0.4, 0.9]}) == pytest.approx(0.5)


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
    (["--mu"], "--mu: expected at least one argument"),
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
    rows = [{**counters(0), "eval_accuracy": 0.1},
            {**counters(1), "rollout_entropy": 0.5}, {**counters(1), "eval_accuracy": 0.2},
            {**counters(2), "rollout_entropy": 0.5}, {**counters(2), "eval_accuracy": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.json").write_text(json.dumps({"prompts_per_round": 32, "num_generations": 8, "batch_size": 256}))
    assert compare.read_run(str(tmp_path), [0, 51_000, 102_000])["accuracy"] == [0.1, 0.2, 0.3]   # one eval each
    with pytest.raises(compare.CompareError, match="raise --budget-tokens or lower --evals"):
        compare.read_run(str(tmp_path), [0, 30_000, 60_000, 90_000])


def test_target_frac_puts_the_target_on_the_rise_by_hand():
    grid = [0, 1, 2, 3, 4, 5]
    on = [run_of([0.4, 0.6, 0.8, 0.9, 0.9, 0.9], [100 * k for k in grid], [100 * k for k in grid])]
    rep = [run_of([0.4, 0.8, 0.9, 0.9, 0.9, 0.9], [50 * k for k in grid], [100 * k for k in grid])]
    assert compare.target_accuracy(on, 0.5) == pytest.approx(0.65)            # 0.4 + 0.5 * (0.9 - 0.4)
    # frac 0.5: on-policy holds 0.65 from index 2 (smoothed 0.8), replay from index 1 (smoothed 0.8)
    assert compare.compare_arm(rep, on, [8.0], frac=0.5)["token_ratio"] == pytest.approx(500 / 2000)
    # frac 1: the target is 0.9, held from index 3 and 2
    assert compare.compare_arm(rep, on, [8.0])["token_ratio"] == pytest.approx(1000 / 3000)
    assert compare.compare_arm(rep, on, [8.0], frac=0.5)["accuracy_diff"] == pytest.approx(0.0)
    # a falling on-policy curve (0.5 -> 0.3): the target is its final accuracy, which it reaches
    falling = [run_of([0.5, 0.6, 0.4, 0.3, 0.3, 0.3], [100 * k for k in grid], [100 * k for k in grid])]
    assert compare.target_accuracy(falling, 0.9) == pytest.approx(0.3)
    assert compare.compare_arm(rep, falling, [8.0], frac=0.9)["token_ratio"] == pytest.approx(500 / 1000)
