"""The power statement (comparison/power.py): its distributions against printed tables, its power
against the standard sample sizes of a one-sided t-test, its figures on a comparison built by hand,
and the committed statement (docs/results/smollm2_power.json) as power.py gives it today and as
docs/results.md shows it."""
import json
import math
import os
import statistics

import pytest

import compare_async_smollm2
import power

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("p, df, t", [(0.95, 4, 2.1318), (0.95, 9, 1.8331), (0.80, 4, 0.9410),
                                      (0.975, 1, 12.7062), (0.95, 17, 1.7396)])
def test_t_quantiles_are_the_tables(p, df, t):
    assert power.t_quantile(p, df) == pytest.approx(t, abs=1e-4)


@pytest.mark.parametrize("p, df, x", [(0.05, 4, 0.7107), (0.95, 4, 9.4877), (0.5, 10, 9.3418)])
def test_chi_square_quantiles_are_the_tables(p, df, x):
    assert power.chi2_quantile(p, df) == pytest.approx(x, abs=1e-4)


def test_power_is_the_one_sided_t_test_s():
    """No effect: detected 5% of the time. The sample sizes every table gives for a one-sided
    one-sample t-test at 5% and 80% power: 8 at an effect of one sd, 27 at half of one."""
    p = power.Power()
    assert p.at(5, 0.0) == pytest.approx(0.05, abs=0.005)
    assert p.at(12, 0.0) == pytest.approx(0.05, abs=0.005)
    assert p.seeds_needed(1.0) == 8 and p.seeds_needed(0.5) == 27
    assert p.at(8, p.smallest(8)) >= 0.8 > p.at(8, p.smallest(8) - 0.01)


def run(accs, tokens, entropy):
    return {"accuracy": accs, "tokens": tokens, "seconds": tokens, "rounds": tokens,
            "steps": tokens, "entropy": entropy}


def comparison_by_hand() -> dict:
    """Three replicates. On-policy i: evals 0.1, 0.3, 0.5, 0.6 + d_i at 0, 1000, 2000, 3000 tokens
    (d = 0, 0.06, 0.12): it first reaches 0.45 at 1,750 tokens. Replay i: 0.1, 0.5, 0.6, 0.6 at
    k_i times those tokens (k = 0.5, 0.6, 0.8): it first reaches 0.45 at 875 k_i. Control:
    on-policy's runs."""
    tokens = [0, 1000, 2000, 3000]
    on = [run([0.1, 0.3, 0.5, 0.6 + d], tokens, 0.5) for d in (0, 0.06, 0.12)]
    rep = [run([0.1, 0.5, 0.6, 0.6], [k * t for t in tokens], 0.5 - e)
           for k, e in ((0.5, 0.1), (0.6, 0.2), (0.8, 0.4))]
    arms = {"on_policy": on, "replay": rep, "control": on}
    return {"target_accuracy": 0.55, "arms": {a: {"replicates": r} for a, r in arms.items()}}


def test_the_figures_of_a_comparison_by_hand():
    s = power.statement(comparison_by_hand(), 0.45, power=power.Power(4000), seeds=(5, 10))
    f = s["pairs"]["replay / on_policy"]
    logs = [math.log(875 * k / 1750) for k in (0.5, 0.6, 0.8)]
    first = f["first_reach_tokens_log_ratio"]
    assert first["per_seed"] == pytest.approx(logs)
    assert first["sd"] == pytest.approx(statistics.stdev(logs))
    assert first["effect"] == pytest.approx(-math.log(0.6))
    lo, hi = first["sd_ci"]              # sd sqrt(2 / chi2(0.95, 2)), sd sqrt(2 / chi2(0.05, 2))
    assert lo == pytest.approx(first["sd"] * math.sqrt(2 / 5.9915), rel=1e-4)
    assert hi == pytest.approx(first["sd"] * math.sqrt(2 / 0.10259), rel=1e-4)
    # the area: replay (300 + 550 + 600) k / 3000 k; on-policy (200 + 400 + (1.1 + d) 500) / 3000
    area = f["area_diff"]
    assert area["per_seed"] == pytest.approx([(1450 - 1150 - 500 * d) / 3000
                                              for d in (0, 0.06, 0.12)])
    # a 40% saving of on-policy's mean curve (0.1, 0.3, 0.5, 0.66; its area A = 1180 / 3000) adds
    # 0.4 (0.66 - A)
    assert area["saving_per_unit"] == pytest.approx(0.66 - 1180 / 3000)
    assert area["effect"] == pytest.approx(0.4 * (0.66 - 1180 / 3000))
    assert area["smallest_saving_at"]["10"] == pytest.approx(
        area["smallest_diff_at"]["10"] / area["saving_per_unit"])
    # on-policy's own target 0.55: between 0.5 and 0.6 + d (at 2000 + 1000 * 0.05 / (0.1 + d));
    # replay between 0.5 and 0.6, halfway (1500 k)
    own = f["own_target_first_reach_tokens_log_ratio"]
    assert own["per_seed"] == pytest.approx([math.log(1500 * k / (2000 + 50 / (0.1 + d)))
                                             for k, d in ((0.5, 0), (0.6, 0.06), (0.8, 0.12))])
    assert f["entropy_tail_diff"]["per_seed"] == pytest.approx([-0.1, -0.2, -0.4])
    assert f["final_accuracy_diff"]["per_seed"] == pytest.approx([0.1] * 3)    # 0.6 against 0.5
    p = power.Power(4000)
    assert first["seeds_needed"] == p.seeds_needed(first["effect"] / first["sd"])
    assert first["smallest_saving_at"]["10"] == pytest.approx(
        1 - math.exp(-p.smallest(10) * first["sd"]))
    need = [f[k]["seeds_needed_at_sd_hi"] for f in s["pairs"].values() for k in power.PRIMARY]
    assert s["seeds_planned"] == max(10, *need)


def test_the_committed_statement_is_what_power_py_gives_and_the_page_shows_it():
    path = os.path.join(ROOT, "docs", "results", "smollm2_power.json")
    committed = json.load(open(path))
    again = power.main(["--output", os.devnull])
    assert json.loads(json.dumps(again)) == committed
    assert committed["seeds_planned"] >= 10 and committed["source"] == power.SOURCE
    page = open(os.path.join(ROOT, "docs", "results.md")).read()
    assert power.table(committed) in page and power.differences_table(committed) in page


def test_the_planned_command_is_the_page_s_and_compare_py_reads_it(capsys):
    """The command on the page is the script's, with the seeds the power statement plans; compare.py
    parses it, or, on a train.py without the async workers, refuses it for --generators alone."""
    import compare
    import train
    argv = compare_async_smollm2.compare_argv(compare_async_smollm2.planned_seeds())
    page = open(os.path.join(ROOT, "docs", "results.md")).read()
    assert compare_async_smollm2.command(argv) in page
    if "generators" in train.Config.__dataclass_fields__:
        args = compare.parse(argv)
        assert args.target == 0.45 and args.target_rule == "first" and args.seeds >= 10
    else:
        with pytest.raises(SystemExit):
            compare.parse(argv)
        assert "unrecognized arguments: --generators" in capsys.readouterr().err


# ---- the exact power (issue 67): the noncentral t without simulation --------------------------
EFFECT_25 = -math.log(0.75) / 0.3981461232210191     # a 25% saving at the decisive look's sd


@pytest.mark.parametrize("n, effect, alpha, reference", [
    (18, EFFECT_25, 0.05, 0.9023833510653331), (10, EFFECT_25, 0.025, 0.5315310883040847),
    (2, 1.0, 0.05, 0.17956248755732773), (3, 1.0, 0.05, 0.32183640914846035)])
def test_exact_power_is_scipys_noncentral_t(n, effect, alpha, reference):
    """Reference values from scipy, computed outside the repository (scipy is no dependency):
    1 - nct.cdf(t.ppf(1 - alpha, n - 1), n - 1, sqrt(n) * effect)."""
    assert power.exact_power(n, effect, alpha) == pytest.approx(reference, abs=1e-9)


@pytest.mark.parametrize("n, alpha", [(2, 0.05), (5, 0.05), (18, 0.05), (2, 0.025), (10, 0.025)])
def test_exact_power_at_no_effect_is_alpha(n, alpha):
    assert power.exact_power(n, 0.0, alpha) == pytest.approx(alpha, abs=1e-7)


def test_exact_seeds_needed_for_a_25pct_saving_at_the_decisive_sd():
    """18 seeds at one-sided 0.05, 23 at 0.025: the fewest with power >= 0.9 (the one before
    below it)."""
    assert power.exact_seeds_needed(EFFECT_25, 0.9, 0.05) == 18
    assert power.exact_seeds_needed(EFFECT_25, 0.9, 0.025) == 23
    assert power.exact_power(17, EFFECT_25, 0.05) < 0.9 <= power.exact_power(18, EFFECT_25, 0.05)
    assert power.exact_power(22, EFFECT_25, 0.025) < 0.9 <= power.exact_power(23, EFFECT_25, 0.025)
    assert power.exact_seeds_needed(0.01, 0.9, 0.05, most=20) is None
