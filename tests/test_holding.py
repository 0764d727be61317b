"""Issue 67, part 3: holding the target (comparison/holding.py), on made-up runs against
hand-computed values, its exact interval and test against the binomial sums, and the committed JSON
as the script gives it today and as docs/results.md shows it."""
import json
import math
import os
import statistics

import pytest

import holding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def curve(accuracy):
    return {"accuracy": accuracy}


def test_a_runs_peak_final_and_fall():
    """Peak: the highest eval after the start; final: the last; fell: below 0.30 after first
    reaching 0.45 (a dip before the reach, or to 0.30 itself, is no fall)."""
    r = holding.run_figures(curve([0.15, 0.2, 0.5, 0.25, 0.4]))
    assert r == {"peak": 0.5, "final": 0.4, "reached": True, "fell": True,
                 "lowest_after_reach": 0.25}
    assert not holding.run_figures(curve([0.15, 0.1, 0.45, 0.30, 0.5]))["fell"]
    never = holding.run_figures(curve([0.5, 0.2, 0.4, 0.1]))       # the start is not a reach
    assert never == {"peak": 0.4, "final": 0.1, "reached": False, "fell": False,
                     "lowest_after_reach": None}


@pytest.mark.parametrize("k, n, lo, hi", [
    (0, 8, 0.0, 1 - 0.05 ** (1 / 8)),            # k = 0: the upper end solves (1 - p)^n = 0.05
    (10, 10, 0.05 ** (1 / 10), 1.0),             # k = n: the lower end solves p^n = 0.05
    (2, 10, 0.036771, 0.506901),                 # the p where P(X >= k) = 0.05 and P(X <= k) =
    (1, 8, 0.006391, 0.470679),                  # 0.05, solved on the binomial sums themselves
])
def test_the_clopper_pearson_interval_against_hand_computed_values(k, n, lo, hi):
    assert holding.clopper_pearson(k, n) == [pytest.approx(lo, abs=1e-6),
                                             pytest.approx(hi, abs=1e-6)]


def test_fishers_exact_test_against_hand_computed_values():
    """2 of 10 against 0 of 8: given 2 in all, the tables x = 0, 1, 2 of the first arm have
    probabilities C(8,2), C(10,1) C(8,1), C(10,2) over C(18,2) = 28, 80, 45 / 153; at most as likely
    as 45: 28 + 45. 1 of 8 against 1 of 8: 1."""
    assert holding.fisher_exact(2, 10, 0, 8) == pytest.approx(73 / 153)
    assert holding.fisher_exact(1, 8, 1, 8) == pytest.approx(1.0)
    assert holding.fisher_exact(0, 5, 5, 5) == pytest.approx(2 / 252)


def test_the_readout_against_hand_computed_values():
    """Three seeds, two arms. On-policy peaks 0.5, 0.6, 0.4 and ends there, none falls, seed 2
    never reaches. Replay: seed 0 peaks 0.6 and falls to 0.1 (final 0.2), seed 1 peaks 0.5 and
    ends at 0.5, seed 2 peaks 0.7, ends 0.6. Peak differences +0.1, -0.1, +0.3: mean +0.1, sd 0.2,
    the 90% interval +0.1 -+ 2.919986 x 0.2 / sqrt 3."""
    on = {0: curve([0.15, 0.5, 0.5]), 1: curve([0.15, 0.6, 0.6]), 2: curve([0.15, 0.4, 0.4])}
    rep = {0: curve([0.15, 0.6, 0.1, 0.2]), 1: curve([0.15, 0.5, 0.5, 0.5]),
           2: curve([0.15, 0.7, 0.6, 0.6])}
    for c in on.values():
        c["accuracy"].append(c["accuracy"][-1])
    out = holding.readout({"on_policy": on, "replay": rep})
    r, o = out["arms"]["replay"], out["arms"]["on_policy"]
    assert (r["reached"], r["fell"], o["reached"], o["fell"]) == (3, 1, 2, 0)
    assert r["fell_seeds"] == {"0": {"peak": 0.6, "lowest_after_reach": 0.1, "final": 0.2}}
    assert r["peak"]["mean"] == pytest.approx(0.6) and o["final"]["mean"] == pytest.approx(0.5)
    half = 2.919986 * statistics.stdev([0.2, 0.5, 0.6]) / math.sqrt(3)
    assert r["final"]["interval_90"] == pytest.approx([0.4333333 - half, 0.4333333 + half],
                                                      abs=1e-5)
    assert r["fell_interval_90"] == pytest.approx(holding.clopper_pearson(1, 3))
    pair = out["pairs"]["replay/on_policy"]
    assert pair["peak"]["values"] == pytest.approx([0.1, -0.1, 0.3])
    half = 2.919986 * 0.2 / math.sqrt(3)
    assert pair["peak"]["interval_90"] == pytest.approx([0.1 - half, 0.1 + half], abs=1e-5)
    assert pair["final"]["values"] == pytest.approx([-0.3, -0.1, 0.2])
    assert pair["fell_fisher_p"] == pytest.approx(1.0)      # 1 of 3 against 0 of 2


def test_the_committed_json_is_what_the_script_gives_and_the_page_shows(tmp_path):
    name = os.path.join("docs", "results", "smollm2_decisive_holding.json")
    committed = json.load(open(os.path.join(ROOT, name)))
    again = holding.main(["--output", str(tmp_path / "h.json")])
    assert json.loads(json.dumps(again)) == committed
    arms = committed["arms"]
    # what issue 67 found by reading the records: replay seeds 103 and 106 fell, 106 to 0.08;
    # control seed 104 to 0.02 at the end
    assert set(arms["replay"]["fell_seeds"]) == {"103", "106"}
    assert arms["replay"]["fell_seeds"]["106"]["final"] == pytest.approx(0.08)
    assert arms["control"]["fell_seeds"]["104"]["final"] == pytest.approx(0.02)
    assert arms["on_policy"]["fell"] == 0
    page = open(os.path.join(ROOT, "docs", "results.md")).read()
    assert holding.table(name) in page


def test_the_confirmatory_json_is_what_the_script_gives_and_the_page_shows(tmp_path):
    name = os.path.join("docs", "results", "smollm2_confirmatory_holding.json")
    committed = json.load(open(os.path.join(ROOT, name)))
    again = holding.main(["--comparison", "confirmatory", "--output", str(tmp_path / "h.json")])
    assert json.loads(json.dumps(again)) == committed
    assert set(committed["arms"]) == {"on_policy", "replay"} and len(committed["seeds"]) == 18
    page = open(os.path.join(ROOT, "docs", "results.md")).read()
    assert holding.table(name) in page
