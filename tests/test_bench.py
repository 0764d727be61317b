"""The benchmark runs end to end on a small round and ends with its JSON line (no speed asserted:
timings on a shared machine are too noisy for a test; the benchmark is for reading)."""
import json
import math
import os
import sys

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
