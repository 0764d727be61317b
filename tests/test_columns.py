"""The written-work task (--task columns): its work by hand, its reward, its split, and the shipped
warm start: well-formed work with one learnable mistake (dropped carries), an answer that follows
the work, and groups of G that are mostly mixed at step 0."""
import json
import random
import statistics

import pytest
import torch

from infra import demo_model
import tasks
from tasks import column_work


@pytest.fixture(scope="module")
def columns():
    return tasks.load_task("columns")


@pytest.fixture(scope="module")
def columns_model(columns):
    """The shipped warm start of the task (demo/columns.safetensors), with its tokenizer."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(demo_model.tiny_model(columns)).eval(), demo_model.char_tokenizer()


def test_column_work_by_hand():
    assert column_work("347+285=") == "7+5+0=12,4+8+1=13,3+2+1=06:632"
    assert column_work("9999+9999=") == "9+9+0=18,9+9+1=19,9+9+1=19,9+9+1=19:19998"   # the last carry in front
    assert column_work("1000+2000=") == "0+0+0=00,0+0+0=00,0+0+0=00,1+2+0=03:3000"
    rng = random.Random(0)
    # the sloppy teacher: every carry of 1 written as 0, its sums and answer following its own work
    assert column_work("347+285=", 1.0, rng) == "7+5+0=12,4+8+0=12,3+2+0=05:522"
    assert column_work("9999+9999=", 1.0, rng) == "9+9+0=18,9+9+0=18,9+9+0=18,9+9+0=18:18888"
    assert column_work("123+456=", 1.0, rng) == column_work("123+456=")           # no carry: nothing to drop


def test_the_sloppy_teacher_keeps_each_carry_with_probability_0_3():
    rng = random.Random(1)
    one = sum(column_work("347+215=", 0.7, rng) == column_work("347+215=") for _ in range(20_000)) / 20_000
    two = sum(column_work("347+285=", 0.7, rng) == column_work("347+285=") for _ in range(20_000)) / 20_000
    assert one == pytest.approx(0.3, abs=0.015) and two == pytest.approx(0.09, abs=0.01)


def test_reward_is_the_right_answer_in_the_format_and_does_not_grade_the_work(columns):
    p = next(p for p in columns.eval_prompts if column_work(p) != column_work(p, 1.0, random.Random(0)))
    right, answer = column_work(p), columns.answers[p]
    assert columns.reward(p, right) == 1.0 and columns.reward(p, f" {right} ") == 1.0
    assert columns.reward(p, column_work(p, 1.0, random.Random(0))) == 0.0     # a dropped carry, a wrong answer
    assert columns.reward(p, answer) == 0.0                                     # no work: not the format
    assert columns.reward(p, right.replace(":", ";")) == 0.0
    assert columns.reward(p, right + "0") == 0.0
    wrong_work = column_work(p, 1.0, random.Random(0)).rsplit(":", 1)[0] + ":" + answer
    assert columns.reward(p, wrong_work) == 1.0           # only the answer is graded: the work is for the model


def test_split_is_fixed_disjoint_and_of_equal_length_operands(columns):
    again = tasks.column_task()
    assert again.train_prompts == columns.train_prompts and again.eval_prompts == columns.eval_prompts
    assert len(columns.train_prompts) == 20_000 and len(columns.eval_prompts) == 500
    assert not set(columns.train_prompts) & set(columns.eval_prompts)
    lengths = [tuple(map(len, p[:-1].split("+"))) for p in columns.train_prompts]
    assert set(lengths) == {(3, 3), (4, 4)}
    assert 0.45 < sum(a == 3 for a, _ in lengths) / len(lengths) < 0.55
    tokens = [len(column_work(p)) + 1 for p in columns.eval_prompts]          # characters + EOS
    assert min(tokens) == 31 and max(tokens) == 42 and columns.max_new_tokens >= max(tokens)


def complete(model, tokenizer, texts, max_new_tokens):
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)


def test_the_shipped_start_answers_from_its_work(columns, columns_model):
    """The answer depends on the work: given work with every carry dropped (or none), the model
    writes the answer that work gives, not the sum; so RL has to mend the work itself."""
    model, tokenizer = columns_model
    rng = random.Random(0)
    prompts = [p for p in columns.eval_prompts if column_work(p) != column_work(p, 1.0, rng)][:100]
    for drop in (1.0, 0.0):
        works = [column_work(p, drop, rng) for p in prompts]
        heads = [p + w[:w.index(":") + 1] for p, w in zip(prompts, works)]
        answers = complete(model, tokenizer, heads, max_new_tokens=7)
        follows = sum(a == w.split(":")[1] for a, w in zip(answers, works)) / len(prompts)
        assert follows >= 0.95, (drop, follows)


def test_the_shipped_start_writes_well_formed_work_and_most_groups_are_mixed(columns, columns_model):
    from rollout import generate_rollouts
    model, tokenizer = columns_model
    texts = complete(model, tokenizer, columns.eval_prompts[:200], columns.max_new_tokens)
    well_formed = sum(tasks._COLUMN_WORK_RE.fullmatch(t) is not None for t in texts) / len(texts)
    dropped = sum(t == column_work(p, 1.0, random.Random(0)) for p, t in zip(columns.eval_prompts, texts))
    assert well_formed == 1.0 and dropped / len(texts) >= 0.95        # greedy: every carry dropped
    torch.manual_seed(0)
    _, stats = generate_rollouts(model, tokenizer, columns.train_prompts[:48], columns.reward, num_generations=8,
                                 max_new_tokens=columns.max_new_tokens, policy_version=0)
    assert stats["zero_adv_frac"] < 0.5 and 0.2 < stats["reward"] < 0.5
    assert 34 <= stats["completion_len"] <= 40


@pytest.mark.slow
def test_the_demo_model_learns_to_carry_in_its_written_work(tmp_path):
    """The task's learning test: the default round (R = 128, B = N = 256, each rollout used twice)
    and the task's own completion length, 10 rounds instead of 50."""
    import train
    result = train.main(["--task", "columns", "--output-dir", str(tmp_path), "--seed", "0", "--max-rounds", "10",
                         "--eval-every", "10", "--eval-prompts", "200", "--no-progress", "--no-plot"])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "eval_accuracy" not in r]
    assert 34 <= statistics.mean(r["completion_len"] for r in steps) <= 40          # the written work, not a shortcut
    gain = result["final_accuracy"] - result["first_accuracy"]
    print(f"accuracy {result['first_accuracy']:.3f} -> {result['final_accuracy']:.3f}")
    # these settings, one thread, RL seeds 0, 1, 2: 0.250 -> 0.995, 1.000, 0.935 (+0.745, +0.750, +0.685);
    # the task's matrix (comparison/demo_matrix.py, 50 rounds) gained +0.742 to +0.758 in all 12 cells
    assert gain >= 0.5, (result["first_accuracy"], result["final_accuracy"])
