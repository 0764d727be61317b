"""Edge cases of the loop's documented knobs (each of these misbehaved silently or crashed once)."""
import json
import os
import signal

import pytest
import torch

from infra import checkpoint
import train
from infra import policy
import replay_rl


def step_rows(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r for r in rows if "eval_accuracy" not in r]


def test_max_age_holds_at_every_update_not_only_once_a_round(tmp_path, tiny_path):
    # R = N = B = 16, K = 4: after one update the round's rollouts are 1 step old, after two 2 steps old
    result = train.main(["--prompts-per-round", "4", "--num-generations", "4", "--buffer-size", "16",
                         "--batch-size", "16", "--updates-per-round", "4", "--max-age", "1", "--max-rounds", "3",
                         "--eval-prompts", "20", "--output-dir", str(tmp_path)])
    rows = step_rows(tmp_path)
    assert rows and max(r["age_max"] for r in rows) <= 1
    assert [r["round"] for r in rows] == [1, 1, 2, 2, 3, 3]          # two updates a round, the other two lapse
    assert result["lapsed_updates"] == 6 and rows[-1]["lapsed_updates"] == 4     # logged before round 3's lapse


def test_a_round_cut_short_is_done_again_on_resume_with_the_flags_given_then(tmp_path, tiny_path,
                                                                            monkeypatch):
    """A stop in round 1's first update saves the run as round 1 began (checkpoint-0); a resume
    with a larger B and K does round 1 again with them: the buffer holds 16 after it (no update:
    too few for 32), 32 after round 2 (three updates of 32), and so on."""
    flags = ["--prompts-per-round", "4", "--num-generations", "4", "--buffer-size", "64",
             "--batch-size", "16", "--updates-per-round", "2", "--eval-prompts", "20",
             "--eval-every", "1000", "--max-rounds", "3", "--output-dir", str(tmp_path)]
    real, calls = replay_rl.update_step, []

    def interrupted_update(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)        # during round 1's first update
        return real(*a, **k)

    monkeypatch.setattr(replay_rl, "update_step", interrupted_update)
    with pytest.raises(SystemExit):
        train.main(flags)
    monkeypatch.setattr(replay_rl, "update_step", real)
    assert checkpoint.find(str(tmp_path)).endswith("checkpoint-0")
    state = json.load(open(os.path.join(checkpoint.find(str(tmp_path)), "state.json")))["state"]
    assert (state["round"], state["step"]) == (0, 0)
    train.main(["--resume", str(tmp_path), "--batch-size", "32", "--updates-per-round", "3"])
    rows = step_rows(tmp_path)
    assert [r["round"] for r in rows if r.get("updates") == 0] == [1]      # 16 held: no update
    assert [(r["round"], r["batch_size"]) for r in rows if "batch_size" in r] == \
        [(2, 32)] * 3 + [(3, 32)] * 3


@pytest.mark.parametrize("loss", ["tis", "ppo"])
def test_one_generation_per_prompt_is_refused_where_it_trains_nothing(loss, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_config(["--num-generations", "1", "--loss", loss, "--buffer-size", "32", "--batch-size", "32"])
    assert e.value.code == 2 and "advantage 0" in capsys.readouterr().err
    cfg = train.parse_config(["--num-generations", "1", "--loss", "asymre", "--buffer-size", "32",
                              "--batch-size", "32"])
    assert cfg.num_generations == 1                    # asymre's coefficient is tau there: it trains


def test_zero_advantage_filter_is_refused_with_asymre(capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_config(["--skip-zero-advantage", "--loss", "asymre"])
    assert e.value.code == 2 and "asymre" in capsys.readouterr().err
    assert train.parse_config(["--skip-zero-advantage", "--loss", "tis"]).skip_zero_advantage


def test_logged_ref_kl_does_not_depend_on_the_micro_batch(tiny_path, addition):
    import replay_rl
    from infra import engineered_update
    from rollout import end_token_ids, generate_rollouts
    torch.manual_seed(0)
    model, tok = policy.load_policy(tiny_path, lora_r=4)
    for name, p in model.named_parameters():          # an adapter that moved: KL to the base is not 0
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    prompts = ["1+2=", "45+67=", "9+99=", "80+0=", "12+34=", "5+5="]
    rollouts, _ = generate_rollouts(model, tok, prompts, addition.reward, num_generations=4, max_new_tokens=5, policy_version=0)
    assert len({len(r.completion_ids) for r in rollouts}) > 1          # unequal lengths: the weighting matters
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    figures = {}
    for micro in (0, 5):
        model.load_state_dict(start, strict=False)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        figures[micro] = engineered_update.update_step_engineered(model, opt, rollouts, pad_id=tok.pad_token_id,
                                               eos_ids=end_token_ids(model, tok)[0], current_version=0,
                                               beta=0.1, normalization="sequence_mean", micro_batch_size=micro)
    assert figures[0]["ref_kl"] > 1e-4
    assert figures[5]["ref_kl"] == pytest.approx(figures[0]["ref_kl"], rel=1e-5)
    assert figures[5]["loss"] == pytest.approx(figures[0]["loss"], rel=1e-5)


def test_eval_reward_errors_are_not_training_reward_errors(tmp_path, tiny_path, monkeypatch):
    import tasks
    real = tasks.load_task
    eval_set = set(tasks.addition_task(2).eval_prompts)

    def task_failing_on_eval(name, **kwargs):
        task = real(name, **kwargs)
        good = task.reward
        task.reward = lambda p, c: 1 / 0 if p in eval_set else good(p, c)
        return task

    monkeypatch.setattr(tasks, "load_task", task_failing_on_eval)
    result = train.main(["--prompts-per-round", "4", "--num-generations", "4", "--buffer-size", "16",
                         "--batch-size", "16", "--max-rounds", "2", "--eval-prompts", "7", "--eval-every", "1000",
                         "--on-reward-error", "zero", "--output-dir", str(tmp_path)])
    assert result["reward_errors"] == 0 and result["eval_reward_errors"] == 14        # 7 prompts, 2 evals
    last = json.loads(open(tmp_path / "metrics.jsonl").readlines()[-1])
    assert last["eval_reward_errors"] == 14 and last["reward_errors"] == 0
