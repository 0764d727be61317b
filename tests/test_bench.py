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
    import cost
    import stats
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
    units = stats.unit_costs(stats.load_cost(path), {"on_policy": (16, 8)})
    assert units["plain"]["on_policy"] == (forced["generation"]["plain"][1]["seconds"], forced["training"][0]["seconds"])
    # sampled (the default): the demo's answers end before the limit, as in a run
    sampled = cost.main(["--sizes", "8", "--repeats", "1", "--output", path])
    assert 1 <= sampled["generation"]["plain"][0]["mean_completion_tokens"] < limit
    with pytest.raises(SystemExit):                       # R = prompts x G: a multiple of G
        cost.main(["--sizes", "12", "--output", path])


def test_demo_matrix_passes_its_flags_on_and_runs_one_thread_cells_side_by_side(tmp_path, monkeypatch, capsys):
    """The README's `demo_matrix.py --threads 1 --parallel 2` (and --task, seeds, --goal, a train.py
    flag passed through), with train.py replaced by a stub that writes two evals: the cells' flags and
    thread count reach train.py, two 1-thread cells run at once, a finished cell is read back."""
    import threading
    import demo_matrix
    import records
    both = threading.Barrier(2, timeout=2)          # passes only if two cells run at the same time
    calls = []

    def fake_train(argv, out, env):
        calls.append((argv, env["OMP_NUM_THREADS"], env["REPLAY_RL_CACHE"]))
        both.wait()
        os.makedirs(out, exist_ok=True)
        seed = int(argv[argv.index("--warm-start-seed") + 1])
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            for acc in (0.25, 0.25 + 0.3 * (seed + 1)):              # gains 0.3 and 0.6
                f.write(json.dumps({"eval_accuracy": acc}) + "\n")
    monkeypatch.setattr(records, "build_tiny_model", lambda *a, **k: None)
    monkeypatch.setattr(records, "run_train", fake_train)
    argv = ["--output-dir", str(tmp_path), "--task", "columns", "--warm-start-seeds", "0", "1", "--threads", "1",
            "--rl-seeds", "3", "--parallel", "2", "--goal", "0.5", "--max-rounds", "7"]
    cells = demo_matrix.main(argv)
    assert sorted(int(a[a.index("--warm-start-seed") + 1]) for a, _, _ in calls) == [0, 1]
    for a, threads, cache in calls:
        assert a[a.index("--task") + 1] == "columns" and a[a.index("--seed") + 1] == "3"
        assert a[-2:] == ["--max-rounds", "7"] and threads == "1" and cache == str(tmp_path / "models-t1")
    assert sorted(round(c["gain"], 6) for c in cells) == [0.3, 0.6]
    out = capsys.readouterr().out
    assert out.count("BELOW GOAL") == 1 and "cells at or above +0.50: 1/2" in out
    calls.clear()
    assert demo_matrix.main(argv) == cells and calls == []                  # read back, not run again


def test_the_prefill_benchmark_times_both_paths_on_the_same_samples(tiny_path, tmp_path):
    """benchmarks/prefill.py on the demo: plain and shared interleaved on the same seeds sample the
    same completions; each phase's tokens add up; the load on the machine is kept with the figures."""
    import prefill
    found = prefill.main(["--settings", "demo", "--eval-pairs", "1", "--output", str(tmp_path / "p.json")])
    rounds, evals = found["rounds"]["demo"], found["evals"]["demo"]
    assert rounds["same_completions_every_pair"] and evals["same_completions_every_pair"]
    assert rounds["behaviour_logp_max_diff"] < 1e-5 and rounds["shared_prefix_tokens"] == 0
    plain, shared = rounds["plain"], rounds["shared"]
    assert plain["prefill_tokens"] == 16 * 8 * rounds["prompt_tokens_max"]        # G copies of each prompt
    assert shared["prefill_tokens"] == 16 * (rounds["prompt_tokens_max"] - 1) + 16 * 8   # once, then the last column
    assert plain["decode_tokens"] == shared["decode_tokens"] and rounds["speedup_wall"] > 0
    load = found["load"]["demo"]
    assert load["load_note"] == prefill.LOAD_NOTE and len(load["loadavg_before"]) == 3
    assert 0 < load["process_cpu_over_wall"] <= 1.05


def test_the_docs_state_the_prefill_figures_of_the_committed_json():
    import prefill
    found = json.load(open(prefill.OUTPUT))
    usage = " ".join(open(os.path.join(prefill.ROOT, "docs", "usage.md")).read().split())
    rounds, evals = found["rounds"], found["evals"]
    for setting in ("smollm2", "long_prompt"):
        assert f"{rounds[setting]['speedup_wall']:.2f}x" in usage, setting
        assert f"{evals[setting]['speedup_wall']:.2f}x" in usage, setting
    assert f"({rounds['smollm2']['plain_split']['decode']:.0%} of the" in usage
    assert f"at most {rounds['smollm2']['bound_prefill_free']:.2f}x" in usage
    trl = found["trl"]
    assert (f"took {trl['train_py_shared_over_trl_wall']:.2f}x the seconds of TRL's GRPOTrainer's, "
            f"{trl['train_py_plain_over_trl_wall']:.2f}x without") in usage
    notes = {v["load_note"] for v in [*found["load"].values(), trl]}
    assert len(notes) == 1 and notes.pop() in usage     # one load stated, as the figures had it
    assert all(found[part][s]["same_completions_every_pair"] for part in ("rounds", "evals") for s in found[part])
