"""evaluate.py: a trained adapter scores, on the same prompts, what the training run's final eval
scored; pass@k by hand; one-line errors before any model is loaded."""
import json
import os
import shutil

import pytest

import evaluate
from infra import loading
import train

SMALL = ["--prompts-per-round", "4", "--num-generations", "4", "--buffer-size", "32", "--batch-size", "16",
         "--eval-prompts", "100", "--eval-every", "2", "--seed", "3", "--no-progress", "--no-plot"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_path):
    run = str(tmp_path_factory.mktemp("evaluate") / "run")
    train.main(SMALL + ["--output-dir", run, "--max-rounds", "4"])
    evals = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if "eval_accuracy" in line]
    return run, evals


def test_the_adapter_scores_what_the_final_eval_of_its_run_scored(trained, tmp_path, capsys):
    run, evals = trained
    final = evals[-1]["eval_accuracy"]
    assert evals[-1]["round"] == 4 and final != evals[0]["eval_accuracy"]     # the adapter matters
    result = evaluate.main([run, "--eval-prompts", "100"])
    assert result["eval_accuracy"] == final and result["eval_prompts"] == 100     # exactly: same batches
    assert json.load(open(os.path.join(run, "eval.json"))) == result
    out = capsys.readouterr().out
    assert f"eval_accuracy    {final:.4f}   greedy" in out and "pass@" not in out
    # the same adapter reached as a checkpoint, as a bare adapter, and from a run without adapter/
    assert evaluate.main([os.path.join(run, "checkpoint-4"), "--eval-prompts", "100"])["eval_accuracy"] == final
    bare = str(tmp_path / "bare")
    shutil.copytree(os.path.join(run, "adapter"), bare)
    assert evaluate.main([bare, "--model", "tiny", "--task", "addition", "--eval-prompts", "100",
                          "--output", str(tmp_path / "bare.json")])["eval_accuracy"] == final
    assert json.load(open(tmp_path / "bare.json"))["eval_accuracy"] == final
    evaluate.main([bare, "--model", "tiny", "--task", "addition", "--eval-prompts", "20"])
    assert os.path.isfile(os.path.join(bare, "eval.json"))             # outside a run: in its own folder
    assert not os.path.exists(tmp_path / "eval.json")
    stopped = str(tmp_path / "stopped")                     # a run interrupted before its final adapter
    shutil.copytree(run, stopped)
    shutil.rmtree(os.path.join(stopped, "adapter"))
    result = evaluate.main([stopped, "--eval-prompts", "100"])
    assert result["adapter"].endswith("checkpoint-4/adapter") and result["eval_accuracy"] == final


def test_pass_at_k_by_hand():
    assert evaluate.pass_at_k(4, 0, 4) == 0 and evaluate.pass_at_k(4, 1, 4) == 1
    assert evaluate.pass_at_k(4, 1, 1) == 0.25
    assert evaluate.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)       # 1 - C(3, 2) / C(5, 2)
    # 3 prompts x 4 samples; correct means a reward > 0 (a negative one is not)
    rates = evaluate.pass_rates([[0, 0, 1, 0], [0, -1, 0, 0], [1, 1, 1, 0.5]])
    assert rates["pass@4"] == pytest.approx(2 / 3)
    assert rates["pass@1"] == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert rates["sampled_reward"] == pytest.approx(3.5 / 12)


def test_pass_at_k_of_sampled_completions(trained, capsys):
    run, _ = trained
    result = evaluate.main([run, "--eval-prompts", "50", "--num-generations", "4"])
    assert result["num_generations"] == 4 and result["temperature"] == 1.0     # the run's (default) one
    # 0/1 rewards: pass@1 is the mean sampled reward; one of 4 samples right is likelier than one
    assert result["pass@1"] == pytest.approx(result["sampled_reward"])
    assert 0 < result["pass@1"] < result["pass@4"] <= 1
    assert "pass@4           " in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["{tmp}/nowhere"], "no such folder"),
    (["{tmp}"], "not a run folder of train.py"),
    (["{tiny}"], "not a run folder of train.py"),            # a model folder: config.json of another kind
    (["{bare}"], "--model M --task T"),
    (["{run}", "--checkpoint", "99"], "no checkpoint there; {run} has rounds [4]"),
    (["{run}", "--num-generations", "-2"], "--num-generations -2: must be >= 0"),
    (["{run}", "--num-generations", "1"], "pass@n needs 2 or more"),
    (["{run}", "--task", "sudoku"], "--task sudoku: unknown"),
    (["{run}", "--temperature", "0.7"], "--temperature 0.7: applies to the samples of --num-generations"),
])
def test_what_is_not_an_adapter_is_one_line_before_any_model(trained, tmp_path, tiny_path, capsys, monkeypatch,
                                                               args, message):
    run, _ = trained
    bare = str(tmp_path / "bare")
    shutil.copytree(os.path.join(run, "adapter"), bare)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    names = dict(tmp=str(tmp_path), tiny=tiny_path, bare=bare, run=run)
    with pytest.raises(SystemExit) as e:
        evaluate.main([a.format(**names) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message.format(**names) in err[0], err


def test_samples_follow_the_runs_temperature_unless_given(trained, tmp_path):
    run, _ = trained
    hot = str(tmp_path / "hot")
    shutil.copytree(run, hot)
    with open(os.path.join(hot, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(hot, "config.json"), "w") as f:
        json.dump({**config, "temperature": 0.7}, f)
    args = evaluate.parse([hot, "--num-generations", "4"])
    assert args.temperature == 0.7
    assert evaluate.parse([hot, "--num-generations", "4", "--temperature", "1.5"]).temperature == 1.5


def test_the_earlier_demo_model_is_refused_with_model_tiny_too(saved_run, capsys, monkeypatch):
    """--model tiny rebuilds today's demo model, and scored the old adapter on it (0.05) without a
    word: a run of the earlier one-phase warm start (no warm_start_seed saved) is refused."""
    config = json.load(open(os.path.join(saved_run, "config.json")))
    del config["warm_start_seed"]
    json.dump(config, open(os.path.join(saved_run, "config.json"), "w"))
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for args in ([], ["--model", "tiny"]):
        with pytest.raises(SystemExit) as e:
            evaluate.main([os.path.join(saved_run, "adapter")] + args)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "earlier one-phase warm start" in err[0]
