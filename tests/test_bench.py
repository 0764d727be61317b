"""The benchmark runs end to end on a small round and ends with its JSON line (no speed asserted:
timings on a shared machine are too noisy for a test; the benchmark is for reading)."""
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench  # noqa: E402


def test_bench_ends_with_a_json_line_of_its_figures(tiny_path, capsys):
    bench.main(["--prompts", "4", "--num-generations", "4", "--batch-size", "16", "--buffer-size", "32",
                "--repeats", "3", "--warmup", "1"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("rollout_overhead", "update_overhead", "gen_tokens_per_s", "train_tokens_per_s"):
        assert 0 < figures[key] < math.inf, key
    for key in ("buffer_fraction", "generation_fraction", "training_fraction"):
        assert 0 < figures[key] < 1, key
    # The rollout ratio compares equal work: the bare generate sampled the very same tokens.
    assert figures["same_tokens"] is True
    assert figures["rollouts_per_round"] == 16 and figures["batch_size"] == 16


def test_cost_curve_times_what_train_py_runs_and_compare_reads_it(tiny_path, tmp_path, capsys):
    import compare
    import cost
    path = str(tmp_path / "cost.json")
    forced = cost.main(["--sizes", "8", "16", "--repeats", "3", "--force-length", "--output", path])
    assert forced == json.load(open(path)) and forced["threads"] == 1 and "alone" in forced["conditions"]
    limit = forced["max_new_tokens"]
    # forced: every completion of every point runs to the limit (the end tokens suppressed while generating)
    points = forced["generation"]["plain"] + forced["training"]
    assert [p["mean_completion_tokens"] for p in points] == [limit] * 4
    assert [p["R"] for p in forced["generation"]["plain"]] == [8, 16] and "fast" not in forced["generation"]
    assert all(len(p["runs"]) == 3 and p["seconds"] == sorted(p["runs"])[1] for p in points)   # the median
    # compare.py reads the file: at a measured size the projection uses that point's seconds exactly
    units = compare.unit_costs(compare.load_cost(path), {"on_policy": (16, 8)})
    assert units["plain"]["on_policy"] == (forced["generation"]["plain"][1]["seconds"], forced["training"][0]["seconds"])
    # sampled (the default): the demo's answers end before the limit, as in a run
    sampled = cost.main(["--sizes", "8", "--repeats", "1", "--output", path])
    assert 1 <= sampled["generation"]["plain"][0]["mean_completion_tokens"] < limit
    with pytest.raises(SystemExit):                       # R = prompts x G: a multiple of G
        cost.main(["--sizes", "12", "--output", path])
