"""The four claims' table (comparison/claims.py) is what the committed summaries give, docs/results.md
opens with it as printed, and its verdicts say no more than the intervals."""
import json
import math
import os

import pytest

import claims
import power

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CLAIMS = "## The paper's claims, as the decisive comparison decides them (issue 59)\n"


def test_docs_results_opens_with_the_table_the_summaries_give():
    """The page opens with the confirmatory comparison's section, then the paper's claims: the
    decisive table, the earlier comparisons' table, before the next section."""
    text = open(os.path.join(ROOT, "docs", "results.md")).read()
    table = claims.table()
    assert text.split("\n## ", 1)[1].startswith("The confirmatory comparison (issue 67)")
    claims_section = text.split(CLAIMS, 1)[1].split("\n## ", 1)[0]
    assert table in claims_section and claims.decisive_table() in claims_section


def test_docs_results_opens_with_the_preregistered_table_first():
    """The pre-registered comparison's table (claims.decisive_table, from its verdict JSON) opens the
    page, before the earlier comparisons' table."""
    text = open(os.path.join(ROOT, "docs", "results.md")).read()
    assert claims.decisive_table() in text
    assert text.index(claims.decisive_table()) < text.index(claims.table())


def test_the_wall_clock_pair_on_the_page_is_what_its_verdict_gives():
    """claims.decisive_wall_table, from compare_decisive.py --wall-clock --verdict's JSON, is on the
    page once that JSON is committed; before, the page points to the pair's PENDING.md."""
    text = open(os.path.join(ROOT, "docs", "results.md")).read()
    if os.path.exists(os.path.join(ROOT, claims.DECISIVE_WALL)):
        assert claims.decisive_wall_table() in text
    else:
        assert "records/smollm2_decisive_wall/PENDING.md" in text


def fake_verdict(tmp_path, primary: list[float], alpha: float = 0.025) -> str:
    """A verdict JSON as compare_decisive.verdict writes it, every figure the same values."""
    import compare_decisive
    fig = compare_decisive.paired_test(primary)
    lo, hi = fig["interval_90"]
    fig["seeds_for_90pct_power"] = 12
    pair = {"log_token_ratio": fig, "log_step_ratio": fig, "area_difference": fig,
            "entropy_second_half_difference": fig, "log_compute_ratio": {"paper_5": fig},
            "saving_detected": fig["p_t"] < alpha and fig["p_permutation"] < alpha,
            "saving_of_40pct_excluded": lo > math.log(0.6)}
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"seeds": list(range(len(primary))), "alpha_this_look": alpha,
                                "pairs": {"replay/on_policy": pair, "replay/control": pair}}))
    return str(path)


@pytest.mark.parametrize("d, says", [
    ([-0.9, -0.8, -0.7, -0.6, -0.5, -0.4], "**saving detected**"),
    ([-0.1, 0.1, -0.05, 0.05, 0.0, 0.02], "a 40% saving excluded"),
    ([-0.9, 0.8, -0.7, 0.6, -0.5, 0.4], "**not decided**"),
])
def test_the_preregistered_verdict_follows_the_plans_rule(tmp_path, d, says):
    """The primary figure: detected when both p are below the look's alpha; else a 40% saving is
    excluded when the 90% interval's low end is above log 0.6; else not decided, with the seeds."""
    row = next(r for r in claims.decisive_table(fake_verdict(tmp_path, d)).splitlines()
               if "(the primary figure)" in r)
    assert says in row and ("12 seeds" in row) == (says == "**not decided**")


def test_the_sign_flip_p_toward_a_gain_against_hand_computed_values():
    """d = 1, 2, 3: of the 8 sign flips only all-positive sums to 6 or more: 1/8; d = 1, -1: the
    flips sum to 2, 0, 0, -2, three of them at or above 0: 3/4."""
    assert claims.flipped_p([1.0, 2.0, 3.0]) == 1 / 8
    assert claims.flipped_p([1.0, -1.0]) == 3 / 4


def test_the_lr_check_on_the_page_is_what_its_summaries_give():
    text = open(os.path.join(ROOT, "docs", "results.md")).read()
    assert claims.lr_table() in text
    assert len(claims.lr_table().splitlines()) == 2 + len(claims.LR_CHECK)


STORED_KEYS = (("token_ratio", "token_ratio"), ("step_ratio", "step_ratio"),
               ("first_token_ratio", "first_reach_token_ratio"), ("entropy_diff", "entropy_diff"),
               ("accuracy_diff", "accuracy_diff"), ("instability_diff", "instability_diff"))


def assert_as_stored(figs: dict, stored: dict):
    for pair, entry in stored.items():
        point, ci = figs[pair]
        for key, stored_key in STORED_KEYS:
            as_stored = [None if math.isinf(x) else x for x in ci[key]]
            assert as_stored == pytest.approx(entry[stored_key + "_ci"]), (pair, key)
            assert (None if math.isinf(point[key]) else point[key]) == pytest.approx(entry[stored_key])


def test_a_figure_the_summary_stores_is_the_same_recomputed():
    """claims.py recomputes from the replicates with the summary's own target rule and draws, so the
    pairs a summary already holds come out exactly as stored (a changed rule or seed would not)."""
    s = claims.read(claims.REAL)
    figs = claims.pair_figures(s, [("replay", "on_policy"), ("replay_big", "replay"), ("replay", "control")])
    assert_as_stored(figs, {("replay", "on_policy"): s["arms"]["replay"],
                            ("replay_big", "replay"): s["arms"]["replay_big"]["vs_smaller_buffer"],
                            ("replay", "control"): s["arms"]["replay"]["vs_control"]})


def test_pairs_across_two_comparisons_keep_each_ones_stored_figures():
    """Merging y = 4's summary with the comparison's leaves every draw as it was: the pairs either
    summary stores come out of the merged one exactly as stored, so a pair across them (replay_y4
    vs replay) is drawn on the same replicates."""
    y4, real = claims.read(claims.Y4), claims.read(claims.REAL)
    both = claims.merged([claims.Y4, claims.REAL])
    assert set(both["arms"]) == {"on_policy", "replay_y4", "control_y4", "replay", "replay_big", "control"}
    figs = claims.pair_figures(both, claims.Y4_PAIRS + [("replay", "on_policy"), ("replay", "control")])
    assert_as_stored(figs, {("replay_y4", "on_policy"): y4["arms"]["replay_y4"],
                            ("control_y4", "on_policy"): y4["arms"]["control_y4"],
                            ("replay_y4", "control_y4"): y4["arms"]["replay_y4"]["vs_control"],
                            ("replay", "on_policy"): real["arms"]["replay"],
                            ("replay", "control"): real["arms"]["replay"]["vs_control"]})


def test_summaries_of_other_on_policy_runs_or_draws_are_not_merged(tmp_path):
    """A pair across comparisons means something only if both drew the same target's runs with the
    same draws: other on_policy runs, or another bootstrap count, are refused."""
    def variant(change) -> str:
        s = claims.read(claims.Y4)
        change(s)
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(s))
        return str(path)
    other_run = variant(lambda s: s["arms"]["on_policy"]["replicates"][0]["accuracy"].__setitem__(-1, 0.99))
    other_draws = variant(lambda s: s["args"].__setitem__("bootstrap", 1000))
    for path in (other_run, other_draws):
        with pytest.raises(ValueError, match="not the same on_policy runs"):
            claims.merged([path, claims.REAL])
    assert claims.merged([variant(lambda s: None), claims.REAL])["arms"].keys() >= {"replay_y4", "replay"}


def test_the_y4_comparison_on_the_page_is_what_its_summaries_give():
    text = open(os.path.join(ROOT, "docs", "results.md")).read()
    section = text[text.index("## A real language model"):text.index("## The demo model")]
    assert claims.arms_table(claims.Y4) in section and claims.pairs_table() in section
    assert claims.arms_table() in section
    assert len(claims.pairs_table().splitlines()) == 2 + len(claims.Y4_PAIRS)


@pytest.mark.parametrize("interval, kind, side, words", [
    ([1.1, 1.5], "ratio", "above", "as the paper: the whole interval above 1"),
    ([0.5, 0.9], "ratio", "above", "against the paper: the whole interval below 1"),
    ([0.5, math.inf], "ratio", "below", "no detected difference"),
    ([1.2, math.inf], "ratio", "above", "as the paper: the whole interval above 1"),
    ([-0.1, 0.02], "diff", "not below", "no detected difference (a fall of up to 0.100 not excluded)"),
    ([-0.1, -0.02], "diff", "not below", "against the paper: the whole interval below 0"),
    ([0.01, 0.02], "diff", "not below", "as the paper: the whole interval above 0"),
    ([-0.02, -0.01], "diff", "below", "as the paper: the whole interval below 0"),
])
def test_the_verdict_says_what_the_interval_says(interval, kind, side, words):
    row = ("claim", "measured", "a", "b", "f", kind, side)
    assert claims.verdict({("a", "b"): ({"f": 0.0}, {"f": interval})}, row) == words


def test_a_cell_writes_not_reached_for_an_arm_that_never_held_the_target():
    row = ("claim", "measured", "a", "b", "f", "ratio", "below")
    figs = {("a", "b"): ({"f": math.inf}, {"f": [0.0, math.inf]})}
    assert claims.cell(figs, row) == "not reached [0.00, not reached]"
    assert claims.cell({}, row) == "not run"
    diff = ("claim", "measured", "a", "b", "f", "diff", "below")
    assert claims.cell({("a", "b"): ({"f": -0.05}, {"f": [-0.1, 0.012]})}, diff) == "-0.050 [-0.100, +0.012]"


def stated_figures(node, out: set) -> set:
    """Every figure with its interval in a summary, as this page writes them: a ratio 0.84x [0.47,
    not reached], a difference -0.056 [-0.124, +0.000]."""
    f = lambda x, kind: claims.number(math.inf if x is None else x, kind).rstrip("x")
    if isinstance(node, dict):
        pairs = [(node[k], node[k + "_ci"]) for k in node if k + "_ci" in node]
        pairs += [(node["ratio"], node["ci"])] if "ratio" in node and "ci" in node else []
        for value, (lo, hi) in ((v, c) for v, c in pairs if isinstance(c, list) and len(c) == 2):
            if value is None or isinstance(value, float):
                for kind in ("ratio", "diff"):
                    interval = f"[{f(lo, kind)}, {f(hi, kind)}]"
                    out.add(interval)
                    out.add(f"{claims.number(math.inf if value is None else value, kind)} {interval}")
        for v in node.values():
            stated_figures(v, out)
    elif isinstance(node, list):
        for v in node:
            stated_figures(v, out)
    return out


def written_difference(test: dict) -> str:
    """A paired test's mean with its 90% interval, as the page writes a difference."""
    return claims.written(test, "diff")


def pairwise_differences(final: dict) -> set:
    """{arm: a figure per seed, in seed order}: each two arms' per-seed difference, its mean with
    the paired 90% t-interval (compare_decisive.paired_test), as the page writes it."""
    import compare_decisive
    return {written_difference(compare_decisive.paired_test([x - y for x, y in zip(final[a], final[b])]))
            for a in final for b in final if a != b}


def per_seed_final_differences(name: str) -> set:
    """The final-accuracy difference of each pair of a summary's arms, per seed."""
    from stats import final_accuracy
    arms = claims.read(f"docs/results/{name}")["arms"]
    return pairwise_differences({a: [final_accuracy(r["accuracy"]) for r in e["replicates"]]
                                 for a, e in arms.items()})


def collapse_final_differences() -> set:
    """The collapse runs' (docs/results/smollm2_collapse.json) differences of the mean of the last
    two evals, per seed, between each two arms."""
    runs = json.load(open(os.path.join(ROOT, "docs", "results", "smollm2_collapse.json")))["runs"]
    return pairwise_differences({arm: [r["final2"] for r in sorted(rs, key=lambda r: r["seed"])]
                                 for arm, rs in runs.items()})


def decisive_figures() -> set:
    """The decisive comparison's verdicts (its 6-seed look, docs/results/smollm2_decisive_6seeds.json,
    and the final one, smollm2_decisive.json), as the page writes their figures: each pair's ratios
    (tokens, rollouts, steps, compute) and differences (area, entropy over the second half) with
    their 90% intervals."""
    out = set()
    for name in ("smollm2_decisive_6seeds.json", "smollm2_decisive.json"):
        for pair in json.load(open(os.path.join(ROOT, "docs", "results", name)))["pairs"].values():
            logs = [pair[k] for k in ("log_token_ratio", "log_round_ratio", "log_step_ratio")
                    if k in pair] + list(pair["log_compute_ratio"].values())
            out |= {claims.written(fig, "ratio") for fig in logs}
            out |= {written_difference(pair[name])
                    for name in ("area_difference", "entropy_second_half_difference")}
    wall = os.path.join(ROOT, "docs", "results", "smollm2_decisive_wall.json")
    if os.path.exists(wall):                # its wall-clock pair, once its verdict is written
        out.add(claims.written(json.load(open(wall))["async_replay/on_policy"]["log_seconds_ratio"],
                               "ratio"))
    return out | issue67_figures()


def bare(written: str) -> str:
    """The interval of a written figure, "[lo, hi]"."""
    return "[" + written.split("[", 1)[1]


def issue67_figures(name: str = "decisive") -> set:
    """Issue 67's readings of a comparison, as the page writes their figures: the 95% intervals of
    the verdict's figures, bare (the look's alpha); the compute ratio against the cost ratio at each
    marked ratio and as it grows (cost_ratio.py's JSON); the per-arm and paired figures of holding
    the target (holding.py's JSON)."""
    import cost_ratio
    import holding
    out = set()
    verdict = claims.read(f"docs/results/smollm2_{name}.json")
    for pair in verdict["pairs"].values():
        logs = [pair[k] for k in ("log_token_ratio", "log_round_ratio", "log_step_ratio")]
        out |= {bare(claims.written(f, "ratio", 95)) for f in logs}
        out |= {bare(claims.written(pair[k], "diff", 95))
                for k in ("area_difference", "entropy_second_half_difference")}
    cost = claims.read(f"docs/results/smollm2_{name}_cost_ratio.json")
    for b in cost["bases"].values():
        out |= {cost_ratio.ratio(m) for m in [*b["marked"].values(), b["at_infinity"]]}
    held = claims.read(f"docs/results/smollm2_{name}_holding.json")
    for e in held["pairs"].values():
        for k in ("peak", "final"):
            out.add(holding.interval(e[k], f=holding.diff))
            out.add(bare(holding.interval(e[k], "interval_95", holding.diff)))
    return out


def test_the_real_model_prose_states_only_figures_of_its_summaries():
    """The words under the table and the SmolLM2 section: each figure with an interval, or bare
    interval, is one of the summaries' the table reads (or the table's own); one typed from memory
    fails."""
    import re
    text = open(os.path.join(ROOT, "docs", "results.md")).read()
    prose = text[text.index(claims.table()) + len(claims.table()):text.index("## The demo model")]
    known = set()
    for name in ("smollm2_filtered.json", "smollm2_filtered_half.json", "smollm2_y4.json",
                 "default_lr1e-3_early.json", "tuned_early.json", "async_demo.json",
                 "async_demo_lr1e-3.json", "async_smollm2.json", "async_demo_fair.json"):
        stated_figures(claims.read(f"docs/results/{name}"), known)
    known |= per_seed_final_differences("async_smollm2.json")
    known |= collapse_final_differences()
    known |= decisive_figures()
    table = claims.table() + claims.arms_table() + claims.arms_table(claims.Y4) + claims.pairs_table()
    import cost_ratio
    import holding
    table += (holding.table("docs/results/smollm2_decisive_holding.json")
              + cost_ratio.table("docs/results/smollm2_decisive_cost_ratio.json"))
    stated = json.load(open(os.path.join(ROOT, "docs", "results", "smollm2_power.json")))
    table += power.table(stated) + power.differences_table(stated)     # checked in test_power
    quoted = re.findall(r"(?:(?:\d+\.\d\dx|[+-]\d\.\d{3,4}) )?\[[-+\d][^\]]*\]", " ".join(prose.split()))
    assert len(quoted) >= 15
    for figure in quoted:
        assert figure in known or figure in table, figure


def test_the_readme_verdict_quotes_the_results_page():
    """README's "Does replay pay?" states figures of docs/results.md (checked above against the
    summaries), in at most 10 lines, the real model first."""
    import re
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Does replay pay?\n", 1)[1].split("\n## ", 1)[0]
    results = " ".join(open(os.path.join(ROOT, "docs", "results.md")).read().split())
    assert section.strip().startswith("**On SmolLM2-135M")
    quoted = re.findall(r"(?:\d+\.\d\dx |[+-]\d\.\d{3} )?\[[-+\d][^\]]*\]", " ".join(section.split()))
    assert len(quoted) >= 3
    for figure in quoted:
        assert figure in results, figure


def test_which_runs_shared_the_cores_is_what_their_cpu_seconds_say():
    """The y = 4 section says which runs shared the cores from each record's CPU seconds against its
    wall seconds (a share of a core near 1: a core to itself); the shares it quotes are the
    summaries', and the contended runs are the ones the SmolLM2 section names (seeds 0-2 of
    on_policy and replay, 0-1 of replay_big and control)."""
    text = " ".join(open(os.path.join(ROOT, "docs", "results.md")).read().split())
    real = claims.cpu_shares(claims.REAL, ("on_policy", "replay", "replay_big", "control"))
    y4 = claims.share_range(claims.cpu_shares(claims.Y4, ("replay_y4", "control_y4")))
    quiet = claims.share_range([x for x in real if x >= 0.9])
    contended = claims.share_range([x for x in real if x < 0.9])
    assert (f"every y = 4 run used {y4} of a core, as the comparison's quiet runs did ({quiet}), "
            f"not its contended ones ({contended})") in text
    s = claims.read(claims.REAL)
    shared = {(a, i) for a, e in s["arms"].items() for i, r in enumerate(e["replicates"])
              if r["cpu_seconds"][-1] / r["seconds"][-1] < 0.9}
    assert shared == {("on_policy", 0), ("on_policy", 1), ("on_policy", 2), ("replay", 0),
                      ("replay", 1), ("replay", 2), ("replay_big", 0), ("replay_big", 1),
                      ("control", 0), ("control", 1)}


def test_the_pages_opening_states_only_figures_of_the_decisive_json():
    """The words above the earlier comparisons' table (the decisive comparison's reading): each
    figure with an interval is the decisive JSONs' (90% or, bare, 95%), issue 67's readings', or
    the tables' own."""
    import re
    text = open(os.path.join(ROOT, "docs", "results.md")).read()
    opening = text[text.index(CLAIMS):text.index(claims.table())]
    known = decisive_figures()
    table = claims.decisive_table() + claims.decisive_pairs_table()
    quoted = re.findall(r"(?:(?:\d+\.\d\dx|[+-]\d\.\d{3,4}) )?\[[-+\d][^\]]*\]",
                        " ".join(opening.split()))
    quoted = [q for q in quoted if "%" not in q]            # "[90% paired t-interval]": words
    assert len(quoted) >= 20
    for figure in quoted:
        assert figure in known or figure in table, figure


def test_issue67s_readings_on_the_page_are_their_jsons():
    """The figures issue 67's sentences state without an interval, each from its JSON: the look's
    exact power, the tokens from which the 40% exclusion fails, the 95% low end, the ages of the
    wall-clock pair; the break-evens and where the 90% interval lies; the falls."""
    import cost_ratio
    text = " ".join(open(os.path.join(ROOT, "docs", "results.md")).read().split())
    c = claims.read("docs/results/smollm2_decisive_checks.json")
    power25, power40 = c["power"]["saving_25pct"], c["power"]["saving_40pct"]
    ex = c["exclusion_of_40pct"]
    age = c["age_mean"]
    span = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}"                       # noqa: E731
    for said in (
            f"this look had power {power25['at_look_alpha']:.2f} to detect a 25% saving at 0.025 "
            f"({power25['at_0.05']:.2f} at 0.05; {power40['at_look_alpha']:.2f} for a 40% saving)",
            f"it does ({ex['low_end_90']:.2f}), but that end is a one-sided 0.05 bound: at the "
            f"look's 0.025 the low end is {ex['low_end_95']:.2f}",
            "on-policy's two runs that never reached 0.45 (seeds "
            + " and ".join(map(str, ex["on_policy_never_reached"])) + ")",
            f"had they needed {math.ceil(ex['fails_from_tokens']):,} tokens or more",
            f"async replay's rollouts were {span(age['wall_clock']['async_replay'])} steps old on "
            f"average, run by run, async on-policy's {span(age['wall_clock']['on_policy'])}, "
            f"against {max(age['synchronous']['replay']):.2f} for synchronous replay and "
            f"{max(age['synchronous']['on_policy']):g} for synchronous on-policy"):
        assert said in text, said
    assert c["alpha_this_look"] == 0.025 and len(ex["on_policy_never_reached"]) == 2
    r = claims.read("docs/results/smollm2_decisive_cost_ratio.json")
    rb, tb = r["bases"]["rollouts"], r["bases"]["tokens"]
    for said in (
            f"**On a rollouts basis the mean breaks even at c = {rb['break_even'][0]:.1f}**",
            f"Below c = {rb['crossings']['low_90'][0]:.1f} replay's extra compute is detected",
            f"This CPU ({rb['marked']['cpu']['c']:.2f}) sits just above "
            f"{rb['crossings']['low_90'][0]:.1f}",
            f"the mean breaks even at c = {tb['break_even'][0]:.1f}, replay's extra compute is "
            f"detected below {tb['crossings']['low_90'][0]:.2f} and a saving only above "
            f"{tb['crossings']['high_90'][0]:.0f}",
            f"extra compute only below c = {rb['crossings']['low_95'][0]:.2f} (rollouts) and "
            f"{tb['crossings']['low_95'][0]:.2f} (tokens), a saving nowhere up to 10,000",
            f"the mean breaks even at {rb['break_even'][0]:.1f} per rollout "
            f"({tb['break_even'][0]:.1f} per token)",
            f"this CPU's, {rb['marked']['cpu']['c']:.2f}, measured in the on-policy runs' own "
            f"seconds (one thread; per token {tb['marked']['cpu']['c']:.2f} too)"):
        assert said in text, said
    assert rb["crossings"]["high_90"] == [] and rb["crossings"]["high_95"] == []
    assert tb["crossings"]["high_95"] == [] and r["search"][1] == 10_000
    assert cost_ratio.where(rb, "replay saves") == "at no c up to 10,000"
    h = claims.read("docs/results/smollm2_decisive_holding.json")
    arms, pair = h["arms"], h["pairs"]["replay/on_policy"]
    fell = arms["replay"]["fell_seeds"]
    for said in (
            f"{arms['replay']['fell']} of replay's {arms['replay']['reached']} runs fell below "
            f"0.30 after reaching it, {arms['control']['fell']} of the control's "
            f"{arms['control']['reached']}, none of on-policy's {arms['on_policy']['reached']}",
            f"seed 103 to {fell['103']['lowest_after_reach']:.2f}, ending at "
            f"{fell['103']['final']:.2f}; seed 106 to {fell['106']['final']:.2f}, its last eval",
            f"(seed 104: {arms['control']['fell_seeds']['104']['lowest_after_reach']:.2f} at its "
            f"lowest, {arms['control']['fell_seeds']['104']['final']:.2f} at the end)",
            f"With {arms['replay']['fell']} of {arms['replay']['reached']} against "
            f"{arms['on_policy']['fell']} of {arms['on_policy']['reached']} the difference in "
            f"falls is not detected (Fisher's p {pair['fell_fisher_p']:.2f})",
            f"up to {arms['replay']['fell_interval_90'][1]:.2f} of replay's runs and "
            f"{arms['on_policy']['fell_interval_90'][1]:.2f} of on-policy's"):
        assert said in text, said
    assert fell["106"]["lowest_after_reach"] == fell["106"]["final"]
    assert pair["peak"]["interval_95"][0] > 0
    assert h["pairs"]["replay/control"]["peak"]["interval_95"][0] > 0


def test_the_readme_states_issue67s_readings_as_their_jsons():
    """README's "Does replay pay?": the confirmatory verdict, ratio, p, power and seeds; the
    decisive look's ratio and p; the pooled break-even and where its 90% interval lies (both
    comparisons); this CPU's cost ratios (the two comparisons' runs), each from its JSON."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = " ".join(readme.split("## Does replay pay?\n", 1)[1].split("\n## ", 1)[0].split())
    v = claims.read("docs/results/smollm2_confirmatory.json")
    p = v["primary"]
    both = claims.read("docs/results/smollm2_both_cost_ratio.json")["bases"]["rollouts"]
    d = claims.read("docs/results/smollm2_decisive.json")["pairs"]["replay/on_policy"]
    cpus = [claims.read(f"docs/results/smollm2_{name}_cost_ratio.json")["bases"]["rollouts"]
            ["marked"]["cpu"]["c"] for name in ("decisive", "confirmatory")]
    lo, hi = p["token_ratio_90"]
    assert v["complete"] and v["seeds"] == list(range(200, 218))
    assert p["verdict"] == "neither a saving detected nor a 25% saving excluded"
    assert section.startswith("**On SmolLM2-135M: not decided.** A pre-registered confirmatory "
                              "comparison of 18 new seeds found " + p["verdict"])
    assert not p["saving_detected"] and lo < 0.75 < 1 < hi            # "neither" by the plan
    for said in (
            f"{p['token_ratio']:.2f}x [{lo:.2f}, {hi:.2f}] over the confirmatory 18 seeds, "
            f"one-sided p {p['log_token_ratio']['p_t']:.3f}, above the plan's 0.05",
            f"the test had power {p['power_25pct_at_observed_sd']:.2f} for a 25% saving",
            f"so {p['seeds_for_90pct_power']} would be needed",
            f"{claims.written(d['log_token_ratio'], 'ratio')} over the decisive 10 before them, "
            f"p {d['log_token_ratio']['p_t']:.3f}, above that plan's 0.025",
            f"broke even with on-policy's at a ratio of {both['break_even'][0]:.1f} on average",
            "wholly above 1 (replay costs more) below a ratio of "
            f"{both['crossings']['low_90'][0]:.1f}, and wholly below 1 (replay saves) above "
            f"{both['crossings']['high_90'][0]:.0f}",
            f"This CPU's ratio was {min(cpus):.1f}-{max(cpus):.1f}"):
        assert said in section, said
    assert len(both["crossings"]["high_90"]) == 1 and len(both["break_even"]) == 1


def test_the_confirmatory_section_states_its_jsons():
    """docs/results.md's confirmatory section: the verdict and each figure from
    smollm2_confirmatory.json, and the holding and cost-ratio tables their scripts print."""
    import cost_ratio
    import holding
    text = open(os.path.join(ROOT, "docs", "results.md")).read()
    section = text.split("## The confirmatory comparison (issue 67)", 1)[1].split("\n## ", 1)[0]
    flat = " ".join(section.split())
    v = claims.read("docs/results/smollm2_confirmatory.json")
    p, s = v["primary"], v["sensitivity"]
    t = p["log_token_ratio"]
    for said in (
            f"**Verdict: {p['verdict']}.**",
            f"{p['token_ratio']:.2f}x on-policy's generated tokens [{p['token_ratio_90'][0]:.2f}, "
            f"{p['token_ratio_90'][1]:.2f}]",
            f"one-sided p {t['p_t']:.3f} (t) and {t['p_permutation']:.3f} (sign-flip)",
            f"{v['reached']['on_policy']} of 18 on-policy runs and {v['reached']['replay']} of 18 "
            "replay runs reached 0.45",
            f"{s['token_ratio']:.2f}x [{s['token_ratio_90'][0]:.2f}, {s['token_ratio_90'][1]:.2f}], "
            f"p {s['log_token_ratio']['p_t']:.3f}, the same verdict",
            f"The per-seed sd of the log ratio was {t['sd']:.3f}",
            f"power {p['power_25pct_at_observed_sd']:.2f}, not 0.90",
            f"would take {p['seeds_for_90pct_power']} seeds"):
        assert said in flat, said
    assert s["same_verdict"] and t["p_t"] > 0.05 and t["p_permutation"] > 0.05
    assert holding.table(os.path.join("docs", "results", "smollm2_confirmatory_holding.json")) in section
    for name in ("smollm2_confirmatory_cost_ratio.json", "smollm2_both_cost_ratio.json"):
        assert cost_ratio.table(os.path.join("docs", "results", name)) in section


@pytest.mark.parametrize("i90, i95, side, words", [
    ([0.1, 0.3], [0.05, 0.35], "above", "as the paper at one-sided 0.05 and at this look's 0.025: "
                                        "the whole 90% and 95% intervals above 0"),
    ([0.01, 0.3], [-0.02, 0.33], "above", "as the paper at one-sided 0.05 only (the whole 90% "
                                          "interval above 0); not at this look's 0.025: 95% "
                                          "[-0.020, +0.330]"),
    ([-0.3, -0.01], [-0.33, 0.02], "not below", "against the paper at one-sided 0.05 only (the "
                                                "whole 90% interval below 0); not at this look's "
                                                "0.025: 95% [-0.330, +0.020]"),
    ([-0.1, 0.3], [-0.15, 0.35], "above", None),
])
def test_a_secondary_figure_is_said_at_the_alpha_that_carries_it(i90, i95, side, words):
    """The 90% interval's ends are one-sided 0.05 bounds, the 95% one's the look's 0.025: a figure
    on one side of the line at both, at 0.05 only (with its 95% interval), or at neither (None)."""
    fig = {"mean": sum(i90) / 2, "interval_90": i90, "interval_95": i95}
    assert claims.at_alphas(fig, "diff", side, 0.025) == words


@pytest.mark.parametrize("lo90, lo95, says", [
    (0.62, 0.59, "a 40% saving excluded at one-sided 0.05 only** (the plan's rule: the 90% "
                 "interval's low end 0.62 above 0.60; at 0.025 the 95% interval's, 0.59, is not)"),
    (0.70, 0.65, "a 40% saving excluded** (the 90% and 95% intervals' low ends above 0.60)"),
])
def test_the_40pct_exclusion_is_said_at_the_level_that_carries_it(lo90, lo95, says):
    fig = {"interval_90": [math.log(lo90), 0.0], "interval_95": [math.log(lo95), 0.1]}
    e = {"saving_detected": False, "saving_of_40pct_excluded": True}
    assert says in claims.primary_words(e, fig, 0.025)


def test_the_seeds_for_power_on_the_page_are_exact_at_the_looks_alpha():
    """Every seeds_for_90pct_power of the decisive verdict is the fewest n whose one-sided paired
    t-test at the look's alpha (0.025) has power 0.9 at the figure's effect (a 40% saving for
    tokens and compute, the observed mean for the rest): the power at n - 1 below 0.9."""
    v = claims.read(claims.DECISIVE)
    alpha = v["alpha_this_look"]
    assert alpha == 0.025 and "exactly" in v["seeds_for_90pct_power_rule"]
    checked = 0
    for pair in v["pairs"].values():
        figs = [(pair["log_token_ratio"], True)] + [(f, True) for f in
                                                     pair["log_compute_ratio"].values()]
        figs += [(pair[k], False) for k in ("log_step_ratio", "area_difference",
                                            "entropy_second_half_difference")]
        for fig, saving in figs:
            effect = (-math.log(0.6) if saving else abs(fig["mean"])) / fig["sd"]
            k = fig["seeds_for_90pct_power"]
            if k is None:
                assert power.exact_power(500, effect, alpha) < 0.9
                continue
            assert power.exact_power(k - 1, effect, alpha) < 0.9 <= power.exact_power(k, effect,
                                                                                      alpha)
            checked += 1
    assert checked >= 20
    assert v["pairs"]["replay/control"]["log_token_ratio"]["seeds_for_90pct_power"] == 17
