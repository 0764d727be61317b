"""GSM8K-format tasks, the answer parsing behind their reward, one-line load errors, custom rewards."""
import json
import os
import subprocess
import sys
import time

import pytest

import tasks
from tasks import TaskError, extract_answer, load_reward, load_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def gsm8k_rows(n):
    return [{"question": f"Tom has {i} apples and buys {i + 1} more. How many apples does he have?",
             "answer": f"He has {i} + {i + 1} = <<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1} apples.\n#### {2 * i + 1}"}
            for i in range(n)]


# ---- a local file in GSM8K's format -------------------------------------------------------
def test_jsonl_task_splits_the_last_tenth_for_eval(tmp_path):
    rows = gsm8k_rows(25)
    rows[3]["answer"] = "It costs $1,200 in all.\n#### 1,200"        # commas in the reference
    task = load_task(write_jsonl(tmp_path / "math.jsonl", rows))

    assert len(task.train_prompts) == 23 and len(task.eval_prompts) == 2   # 25 // 10 = 2 held out
    assert not set(task.train_prompts) & set(task.eval_prompts)
    assert rows[-1]["question"] in task.eval_prompts[-1] and rows[0]["question"] in task.train_prompts[0]
    assert all("####" in p for p in task.train_prompts)                    # the format instruction
    assert task.answers[task.train_prompts[3]] == "1200"
    assert task.max_new_tokens > 100 and set(task.eval_rewards) == {"strict", "lenient"}

    p = task.train_prompts[0]                                              # reference: 1
    assert task.reward(p, "0 + 1 = 1 apple.\n#### 1") == 1.0
    assert task.reward(p, "#### 2") == 0.0
    assert task.reward(p, "The answer is 1.") == 0.0                      # strict is the default
    assert task.eval_rewards["lenient"](p, "The answer is 1.") == 1.0
    assert task.reward(task.train_prompts[3], "so $1,200.00 in total\n#### $1,200.00") == 1.0


def test_jsonl_task_lenient_mode_and_duplicates(tmp_path):
    rows = gsm8k_rows(12)
    rows.append(dict(rows[2]))                      # also the last line: an eval question
    task = load_task(write_jsonl(tmp_path / "dup.jsonl", rows), reward_mode="lenient")
    assert len(task.eval_prompts) == 1 and len(task.train_prompts) == 11   # the copy left training
    assert task.eval_prompts[0] not in task.train_prompts
    assert task.reward(task.eval_prompts[0], "I think it is 5.") == 1.0


def test_addition_task_is_unchanged():
    task = load_task("addition")
    assert task.name == "addition2" and task.eval_rewards == {} and len(task.eval_prompts) == 500
    assert task.reward("37+45=", "82") == 1.0 and task.reward("37+45=", "#### 82") == 0.0


def test_format_prompts_keeps_rewards_on_the_original_prompt(tmp_path):
    task = load_task(write_jsonl(tmp_path / "math.jsonl", gsm8k_rows(10)), reward_mode="lenient")
    chat = tasks.format_prompts(task, lambda p: f"<user>{p}</user><assistant>")
    assert chat.eval_prompts == [f"<user>{p}</user><assistant>" for p in task.eval_prompts]
    p, q = task.train_prompts[0], chat.train_prompts[0]          # reference: 1
    assert chat.answers[q] == "1" and chat.reward(q, "so 1") == 1.0 and chat.reward(q, "so 2") == 0.0
    assert chat.eval_rewards["strict"](q, "#### 1") == 1.0 and chat.eval_rewards["strict"](q, "so 1") == 0.0
    addition = tasks.format_prompts(load_task("addition"), str.upper)   # digits: the same text, target kept
    assert addition.target("37+45=") == "82" and addition.reward("37+45=", "82") == 1.0
    with pytest.raises(TaskError):
        tasks.format_prompts(task, lambda p: "same text for all")


# ---- answer parsing: hand-written expected values, both modes -----------------------------
@pytest.mark.parametrize("completion, strict, lenient", [
    ("48/2 = 24 in May. 48+24 = 72 in all.\n#### 72", "72", "72"),
    ("#### 72\n\nQuestion: Ann has 5 cats.", "72", "5"),       # strict: the first ####, text after it ignored
    ("The answer is 72.", None, "72"),                          # no '####': strict gives nothing
    ("#### $1,234.00 dollars", "1234", "1234"),
    ("####-5", "-5", "-5"),
    ("#### +7.50", "7.5", "7.5"),
    ("#### 0042", "42", "42"),
    ("#### -0", "0", "0"),
    ("costs -$5 or $-6", None, "-6"),
    ("#### 12 #### 13", "12", "13"),
    ("#### the answer is 5", None, "5"),                        # strict: the number must follow ####
    ("#### ٤٢", None, None),                                    # Arabic-Indic digits do not count
    ("٤٢", None, None),
    ("5-3", None, "3"),                                         # a minus between digits is not a sign
    ("3,4,5", None, "5"),
    ("1,2345", None, "2345"),                                   # not a thousands grouping
    ("v1.2.3", None, "1.2"),
    ("no number here", None, None),
    ("", None, None),
    ("####", None, None),
])
def test_extract_answer(completion, strict, lenient):
    assert extract_answer(completion, "strict") == strict
    assert extract_answer(completion, "lenient") == lenient


def test_huge_and_long_completions_neither_hang_nor_raise(tmp_path):
    big = "7" * 5000                                  # int() refuses more than 4300 digits
    task = load_task(write_jsonl(tmp_path / "big.jsonl", [{"question": "Big?", "answer": f"#### {big}"}] * 1
                                 + gsm8k_rows(3)))
    prompt = next(p for p in task.eval_prompts + task.train_prompts if task.answers[p] == big)
    start = time.perf_counter()
    assert task.reward(prompt, f"so\n#### {big}") == 1.0
    assert task.reward(prompt, f"#### {big}8") == 0.0
    for junk in ["9" * 200_000, "1," * 100_000, "#" * 200_000, "#### " + " " * 200_000, "-$" * 100_000]:
        for mode in tasks.REWARD_MODES:
            extract_answer(junk, mode)
    assert time.perf_counter() - start < 2


# ---- one-line errors ----------------------------------------------------------------------
def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(TaskError) as e:
        fn(*args, **kwargs)
    message = str(e.value)
    assert message and "\n" not in message
    return message


@pytest.mark.parametrize("content, expected", [
    ('{"question": "q", "answer": "#### 1"}\nnot json\n', "line 2: not valid JSON"),
    ('{"question": "q", "answer": "#### 1"}\n{"question": "q2"}\n', "line 2: needs string fields"),
    ('{"question": "q", "answer": "#### 1"}\n["q", "a"]\n', "line 2: needs string fields"),
    ('{"question": "q", "answer": "#### 1"}\n{"question": "q2", "answer": "42"}\n', "line 2: the answer must end"),
    ('{"question": "q", "answer": "#### 1"}\n', "at least 2"),
    ("", "at least 2"),
])
def test_malformed_file_is_one_line_error(tmp_path, content, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    message = one_line_error(load_task, str(path))
    assert expected in message and str(path) in message


def test_missing_file_and_unknown_names_are_one_line_errors(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    assert missing in one_line_error(load_task, missing) and "question" in one_line_error(load_task, missing)
    assert "gsm8k" in one_line_error(load_task, "gsm9k")
    assert "lenient" in one_line_error(load_task, "addition", reward_mode="loose")


def test_offline_gsm8k_fails_fast_with_one_line(tmp_path):
    """An empty cache and HF_DATASETS_OFFLINE=1: the error must come at once, not after retries.
    In a fresh process, so that a GSM8K cached on this machine cannot make the load succeed."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path),
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "OMP_NUM_THREADS": "1"}
    script = ("import sys, time, tasks\n"
              "start = time.perf_counter()\n"
              "try:\n    tasks.load_task('gsm8k')\nexcept tasks.TaskError as e:\n"
              "    print(f'{time.perf_counter() - start:.2f}'); print(e); sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, done.stderr
    seconds, message = done.stdout.strip().split("\n")       # the error is exactly one line
    assert float(seconds) < 5
    assert message.startswith("GSM8K could not be loaded") and "--task path/to/gsm8k.jsonl" in message


def test_gsm8k_uses_train_to_train_and_test_to_eval(monkeypatch):
    """The hub dataset's layout, served from memory (no network): openai/gsm8k 'main', two splits."""
    import datasets

    def fake_load_dataset(path, name):
        assert (path, name) == ("openai/gsm8k", "main")
        rows = gsm8k_rows(7)
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:5]),
                                     "test": datasets.Dataset.from_list(rows[5:])})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = load_task("gsm8k")
    assert task.name == "gsm8k" and len(task.train_prompts) == 5 and len(task.eval_prompts) == 2
    assert task.answers[task.eval_prompts[1]] == "13" and task.reward(task.eval_prompts[1], "#### 13") == 1.0


# ---- a custom reward ----------------------------------------------------------------------
REWARD_MODULE = '''
def length_reward(prompt, completion):
    return len(completion) / 10

def nan_reward(prompt, completion):
    return float("nan")

def one_argument(completion):
    return 1.0

NOT_CALLABLE = 3
'''


@pytest.fixture
def clean_imports(monkeypatch):
    """load_reward adds the current directory to sys.path and imports modules: undo both."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_load_reward_from_a_file_and_a_module(tmp_path, monkeypatch, clean_imports):
    (tmp_path / "my_rewards_file.py").write_text(REWARD_MODULE)
    reward = load_reward(f"{tmp_path / 'my_rewards_file.py'}:length_reward")
    assert reward("p", "12345") == 0.5

    (tmp_path / "my_rewards_mod.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)                          # module:function imports from the current directory
    reward = load_reward("my_rewards_mod:length_reward")
    assert reward("p", "1234567890") == 1.0
    with pytest.raises(ValueError, match="nan"):         # a NaN reward is refused when it happens
        load_reward("my_rewards_mod:nan_reward")("p", "c")


@pytest.mark.parametrize("spec, expected", [
    ("rewards_that_do_not_exist_xyz:f", "cannot import"),
    ("{dir}/missing.py:f", "cannot import"),
    ("{dir}/broken.py:f", "cannot import"),
    ("{dir}/bad_rewards.py:missing", "missing is not defined"),
    ("{dir}/bad_rewards.py:NOT_CALLABLE", "NOT_CALLABLE is not callable"),
    ("{dir}/bad_rewards.py:one_argument", "two arguments"),
    ("no_colon_here", "expected module:function"),
])
def test_load_reward_errors_are_one_line(tmp_path, spec, expected, clean_imports):
    (tmp_path / "bad_rewards.py").write_text(REWARD_MODULE)
    (tmp_path / "broken.py").write_text("def f(prompt, completion):\n    return (\n")   # a SyntaxError
    message = one_line_error(load_reward, spec.format(dir=tmp_path))
    assert expected in message


def test_train_py_offline_gsm8k_is_one_line_and_nonzero_exit(tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path),
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "train.py", "--task", "gsm8k", "--model", "some/model",
                           "--output-dir", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: GSM8K could not be loaded")
    assert not (tmp_path / "run").exists()                    # stopped before anything was written
