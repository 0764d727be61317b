"""Tasks: prompts, reference answers, a reward.

A task is plain data plus one function:
    Task.train_prompts, Task.eval_prompts      disjoint lists of prompt strings
    Task.answers[prompt]                        the reference answer
    Task.reward(prompt, completion) -> float    the verifiable reward, 1.0 for a correct answer
    Task.eval_rewards                           named rewards to report at eval (GSM8K: strict, lenient)
Tasks: ``addition``, ``columns`` (embedded), ``sums`` (for a real instruct model), ``gsm8k`` (Hugging Face ``openai/gsm8k``) or a local ``.jsonl`` file in
GSM8K's format; ``load_reward("module:function")`` loads a custom reward for any of them.
No model code here: the embedded demo model (``--model tiny``) lives in demo_model.py.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import random
import re
import sys
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Task:
    name: str
    train_prompts: list[str]
    eval_prompts: list[str]
    answers: dict[str, str]
    reward: Callable[[str, str], float]
    max_new_tokens: int
    # The completion a supervised warm start trains on (embedded tasks only).
    target: Callable[[str], str] | None = field(default=None, repr=False)
    # Rewards to report on the eval prompts, by name; empty = report ``reward`` alone.
    eval_rewards: dict[str, Callable[[str, str], float]] = field(default_factory=dict, repr=False)
    # The rounds of a run when --max-rounds is not given.
    max_rounds: int = 200


class TaskError(ValueError):
    """A task or reward that cannot be loaded. The message is one line that says what to do."""


# ---- the addition task --------------------------------------------------------------------
def parse_int(text: str) -> int | None:
    """The completion as an integer if it is exactly one (sign and digits, spaces around), else None.
    Parsed with a regex and int(), never eval."""
    m = re.fullmatch(r"\s*(-?\d{1,30})\s*", text)
    return int(m.group(1)) if m else None


def addition_task(digits: int = 2, num_eval: int = 500, split_seed: int = 1234) -> Task:
    """``a+b=`` -> ``a+b`` for a, b < 10**digits. The eval prompts are a fixed random subset of all
    pairs, disjoint from the training prompts (the split does not depend on the run's seed)."""
    n = 10 ** digits
    prompts = [f"{a}+{b}=" for a in range(n) for b in range(n)]
    random.Random(split_seed).shuffle(prompts)
    answers = {p: str(sum(int(x) for x in p[:-1].split("+"))) for p in prompts}

    def reward(prompt: str, completion: str) -> float:
        value = parse_int(completion)
        return float(value is not None and value == int(answers[prompt]))

    return Task(name=f"addition{digits}", train_prompts=prompts[num_eval:], eval_prompts=prompts[:num_eval],
                answers=answers, reward=reward, max_new_tokens=digits + 3, target=lambda p: answers[p],
                max_rounds=100)     # as minimal.py's: 0.988 of the held-out sums at round 100


# ---- the written-work task: column addition, the work before the answer ------------------
def column_work(prompt: str, drop_carry: float = 0.0, rng: random.Random | None = None) -> str:
    """The written work and answer for ``a+b=`` (a and b of the same length): one fixed-width
    column a digit, from the units up, as 'a+b+c=ss' (a digit of a, one of b, c the carry in, ss
    the column's sum in two digits, its first digit the carry out), then ':' and the answer, read
    off the work (the units digits of the columns, the last carry in front):

        column_work("347+285=") == "7+5+0=12,4+8+1=13,3+2+1=06:632"

    With ``drop_carry`` > 0 this is the sloppy teacher of the demo's warm start: it writes each
    carry of 1 as 0 with that probability, and its sums and answer follow its own work, so that a
    dropped carry gives the answer wrong in the matching way ("4+8+0=12" makes 622 of 632)."""
    a, b = prompt.rstrip("=").split("+")
    columns, digits, carry = [], [], 0
    for x, y in zip(map(int, reversed(a)), map(int, reversed(b))):
        if carry and rng is not None and rng.random() < drop_carry:
            carry = 0
        total = x + y + carry
        columns.append(f"{x}+{y}+{carry}={total:02d}")
        digits.append(total % 10)
        carry = total // 10
    return ",".join(columns) + ":" + str(int(str(carry) + "".join(map(str, reversed(digits)))))


# the format of column_work: columns 'a+b+c=ss' separated by ',', then ':' and a number
_COLUMN_WORK_RE = re.compile(r"\s*(?:\d\+\d\+\d=\d\d,)*\d\+\d\+\d=\d\d:(\d{1,30})\s*")


def column_task(num_train: int = 20_000, num_eval: int = 500, split_seed: int = 1234) -> Task:
    """``a+b=`` with a and b of 3 or 4 digits (the same number of digits, each half the time), to
    be answered with the written work of ``column_work`` before the answer: 31-41 tokens where the
    addition task's answers have 2-4. The reward is 1 for the right answer in that format (the work
    is not graded: a wrong carry in it gives a wrong answer). Prompts are drawn once from
    ``split_seed``, the eval prompts disjoint from the training ones."""
    rng, prompts = random.Random(split_seed), {}
    while len(prompts) < num_train + num_eval:
        digits = rng.choice((3, 4))
        low, high = 10 ** (digits - 1), 10 ** digits
        prompts[f"{rng.randrange(low, high)}+{rng.randrange(low, high)}="] = None    # ordered, distinct
    prompts = list(prompts)
    answers = {p: str(sum(int(x) for x in p[:-1].split("+"))) for p in prompts}

    def reward(prompt: str, completion: str) -> float:
        m = _COLUMN_WORK_RE.fullmatch(completion)
        return float(m is not None and int(m.group(1)) == int(answers[prompt]))

    return Task(name="columns", train_prompts=prompts[num_eval:], eval_prompts=prompts[:num_eval],
                answers=answers, reward=reward, max_new_tokens=48, target=column_work, max_rounds=50)


# ---- sums asked in words: a task for a small real instruct model ---------------------------
SUMS_QUESTION = "What is {a} + {b}? Reply with the number only."


def sums_task(num_eval: int = 500, split_seed: int = 1234) -> Task:
    """``What is a + b? Reply with the number only.`` for 2-digit a and b, for a real instruct model
    (``--model smollm2``), asked in its chat template. A reply is graded on its last number (GSM8K's
    lenient reward, ``extract_answer``: '1,234' and '$12' read as numbers): 1.0 if that is a + b,
    else 0.0; a reply with no number scores 0, and one cut off at the token limit is graded on
    what it holds (never an exception). SmolLM2-135M-Instruct often answers at length ("To solve
    this, we need to add 89 and 42. ..."). What RL makes of this grading is in docs/usage.md: it
    rewards the right sum followed by any words without a number. The eval prompts are a fixed
    random 500 of the 8,100 pairs, disjoint from the training ones."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(split_seed).shuffle(pairs)
    prompts = [SUMS_QUESTION.format(a=a, b=b) for a, b in pairs]
    answers = {p: str(a + b) for p, (a, b) in zip(prompts, pairs)}

    def reward(prompt: str, completion: str) -> float:
        return float(extract_answer(completion, "lenient") == answers[prompt])

    return Task(name="sums", train_prompts=prompts[num_eval:], eval_prompts=prompts[:num_eval], answers=answers,
                reward=reward, max_new_tokens=48, max_rounds=40)


TASK_NAMES = ("addition", "addition3", "columns", "sums", "gsm8k")     # or a path to a .jsonl file


def load_task(name: str, reward_mode: str = "strict") -> Task:
    """'addition', 'addition3', 'gsm8k' (Hugging Face openai/gsm8k: train split to train, test split to eval)
    or a path to a .jsonl file in GSM8K's format (see ``jsonl_task``). ``reward_mode`` ('strict'
    or 'lenient', see ``extract_answer``) picks the training reward of the GSM8K-format tasks."""
    if reward_mode not in REWARD_MODES:
        raise TaskError(f"unknown reward mode {reward_mode!r}: expected one of {', '.join(REWARD_MODES)}")
    if name not in TASK_NAMES and not name.endswith(".jsonl"):
        raise TaskError(f"unknown task {name!r}: expected one of {', '.join(TASK_NAMES)} or a path to a .jsonl file")
    if name == "addition":
        return addition_task(2)
    if name == "addition3":           # 3-digit sums: a harder task, sparser rewards for the tiny model
        return addition_task(3)
    if name == "columns":             # the written work before the answer (column_work)
        return column_task()
    if name == "sums":                # for a real instruct model: 2-digit sums asked in words
        return sums_task()
    if name == "gsm8k":
        return gsm8k_task(reward_mode)
    return jsonl_task(name, reward_mode)


def _one_line(e: BaseException) -> str:
    """An exception as 'Type: first line of its message', for one-line errors."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


# ---- GSM8K and files in its format --------------------------------------------------------
GSM8K_INSTRUCTION = "Solve the problem step by step, then give the final answer on its own line as '#### <number>'."
GSM8K_MAX_NEW_TOKENS = 256
REWARD_MODES = ("strict", "lenient")

# A number as GSM8K writes it: optional sign and '$', digits with optional thousands commas
# ('1,234'), optional decimals. ASCII digits only: '\d' also matches e.g. Arabic-Indic '٤٢' (and
# int() reads it as 42), but the references never use them, so such an answer does not count.
# The lookbehind keeps us from starting inside another number: '5-3' is 5 and 3, not 5 and -3;
# '.5' and the '3' of '1.2.3' are not numbers.
_NUMBER = r"(?<![0-9.])([-+]?)\$?([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.([0-9]+))?(?![0-9])"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*" + _NUMBER)          # the number right after '####'
_REFERENCE_RE = re.compile(r"\s*" + _NUMBER + r"\s*")


def _canonical(sign: str, whole: str, frac: str | None) -> str:
    """'-', '01,234', '50' -> '-1234.5'. Compared as strings, never converted: int() refuses
    more than 4300 digits and float() rounds, a string compare does neither."""
    whole = whole.replace(",", "").lstrip("0") or "0"
    frac = (frac or "").rstrip("0")                          # 42.00 -> 42
    number = whole + ("." + frac if frac else "")
    return "-" + number if sign == "-" and number != "0" else number


def extract_answer(completion: str, mode: str = "strict") -> str | None:
    """The final answer of a completion as a canonical number string, or None.

    strict:  the first '#### <number>' (spaces allowed between); text like '#### the answer is 5'
             gives None. The first, so that text generated after the answer cannot change it.
    lenient: the last number anywhere in the completion.
    Normalized: commas, '$', a leading '+', trailing zeros of decimals ('$1,000.00' -> '1000').
    """
    if mode == "strict":
        m = _STRICT_RE.search(completion)
    elif mode == "lenient":
        m = None
        for m in _NUMBER_RE.finditer(completion):
            pass
    else:
        raise ValueError(f"unknown reward mode {mode!r}: expected one of {REWARD_MODES}")
    return _canonical(*m.groups()) if m else None


def parse_reference(answer: str) -> str | None:
    """The canonical number after the last '####' of a GSM8K answer ('...\\n#### 1,200' -> '1200')."""
    _, sep, tail = answer.rpartition("####")
    m = _REFERENCE_RE.fullmatch(tail) if sep else None
    return _canonical(*m.groups()) if m else None


def gsm8k_prompt(question: str) -> str:
    return f"{question.strip()}\n{GSM8K_INSTRUCTION}\n"


def qa_task(name: str, train_rows, eval_rows, reward_mode: str = "strict") -> Task:
    """A Task from (question, answer) pairs in GSM8K format. A question seen twice keeps its first
    answer; one that is also in the eval rows is left out of training, so the sets stay disjoint."""
    answers: dict[str, str] = {}

    def add(rows) -> list[str]:
        prompts = []
        for question, answer in rows:
            prompt = gsm8k_prompt(question)
            if prompt not in answers:
                reference = parse_reference(answer)
                if reference is None:
                    raise TaskError(f"{name}: an answer does not end with '#### <number>': {answer[-80:]!r}")
                answers[prompt] = reference
                prompts.append(prompt)
        return prompts

    eval_prompts = add(eval_rows)
    train_prompts = add(train_rows)
    if not train_prompts or not eval_prompts:
        raise TaskError(f"{name}: needs at least one training and one eval question, "
                        f"got {len(train_prompts)} and {len(eval_prompts)}")

    def make_reward(mode: str) -> Callable[[str, str], float]:
        def reward(prompt: str, completion: str) -> float:
            return float(extract_answer(completion, mode) == answers[prompt])
        return reward

    return Task(name=name, train_prompts=train_prompts, eval_prompts=eval_prompts, answers=answers,
                reward=make_reward(reward_mode), max_new_tokens=GSM8K_MAX_NEW_TOKENS,
                eval_rewards={mode: make_reward(mode) for mode in REWARD_MODES})


def use_local_cache_if_offline() -> None:
    """With no network, make the Hugging Face libraries use their local cache at once: otherwise
    they retry the hub for ~25 s (data sets) to ~50 s (models) before failing. datasets reads the
    variables when it is imported; huggingface_hub (already imported by transformers) is told directly."""
    if (os.environ.get("HF_HUB_OFFLINE") and os.environ.get("HF_DATASETS_OFFLINE")) or hub_reachable():
        return
    import huggingface_hub
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    huggingface_hub.constants.HF_HUB_OFFLINE = True


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def gsm8k_task(reward_mode: str = "strict") -> Task:
    """GSM8K from the Hugging Face hub (or its local cache): 7473 training and 1319 test questions.
    With no network, the local cache is used at once (or a one-line error comes at once)."""
    use_local_cache_if_offline()
    try:
        import datasets
        data = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:      # offline (ConnectionError), a broken cache, ...: all mean the same to the user
        raise TaskError(f"GSM8K could not be loaded ({_one_line(e)}): download it once with network, or pass "
                        "--task path/to/gsm8k.jsonl with 'question' and 'answer' ('... #### 42') fields") from None
    rows = {split: list(zip(data[split]["question"], data[split]["answer"])) for split in ("train", "test")}
    return qa_task("gsm8k", rows["train"], rows["test"], reward_mode)


def jsonl_task(path: str, reward_mode: str = "strict", max_eval: int = 500) -> Task:
    """A local file, one JSON object per line with 'question' and 'answer' in GSM8K's format
    (the answer ends with '#### <number>'; other fields are ignored). The last 10% of the lines
    (at least 1, at most ``max_eval``) are the eval set, the rest the training set: deterministic,
    so to choose the eval questions, put them at the end of the file."""
    usage = "one {\"question\": ..., \"answer\": \"... #### 42\"} per line"
    rows = []
    try:
        with open(path, encoding="utf-8-sig") as f:    # a byte-order mark (Windows editors) too
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise TaskError(f"{path} line {i}: not valid JSON; expected {usage}") from None
                if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                        and isinstance(row.get("answer"), str)):
                    raise TaskError(f"{path} line {i}: needs string fields 'question' and 'answer'; expected {usage}")
                if parse_reference(row["answer"]) is None:
                    raise TaskError(f"{path} line {i}: the answer must end with '#### <number>'; expected {usage}")
                rows.append((row["question"], row["answer"]))
    except FileNotFoundError:
        raise TaskError(f"task file {path} not found; pass a .jsonl file with {usage}") from None
    except OSError as e:
        raise TaskError(f"task file {path} cannot be read ({_one_line(e)}); pass a .jsonl file with {usage}") from None
    except UnicodeDecodeError:
        raise TaskError(f"task file {path} is not UTF-8 text; pass a .jsonl file with {usage}") from None
    if len(rows) < 2:
        raise TaskError(f"task file {path} has {len(rows)} question(s); it needs at least 2 (train and eval)")
    n_eval = min(max_eval, max(1, len(rows) // 10))
    return qa_task(os.path.basename(path), rows[:-n_eval], rows[-n_eval:], reward_mode)


def format_prompts(task: Task, fmt: Callable[[str], str]) -> Task:
    """The task with every prompt passed through ``fmt`` (e.g. a tokenizer's chat template). The
    rewards (and ``target``) still receive the original prompt, so they keep working unchanged."""
    formatted = {p: fmt(p) for p in task.train_prompts + task.eval_prompts}
    original = {f: p for p, f in formatted.items()}
    if len(original) != len(formatted):
        raise TaskError("the prompt format gives two prompts the same text")

    def on_original(fn):
        return lambda prompt, completion: fn(original[prompt], completion)

    return dataclasses.replace(
        task, train_prompts=[formatted[p] for p in task.train_prompts],
        eval_prompts=[formatted[p] for p in task.eval_prompts],
        answers={formatted[p]: a for p, a in task.answers.items() if p in formatted},
        reward=on_original(task.reward), eval_rewards={k: on_original(f) for k, f in task.eval_rewards.items()},
        target=None if task.target is None else (lambda prompt: task.target(original[prompt])))


# ---- a custom reward ----------------------------------------------------------------------
def load_reward(spec: str) -> Callable[[str, str], float]:
    """The reward function named by ``spec``, for ``--reward``:

        module:function           a module importable from the current directory or sys.path
        path/to/file.py:function  a Python file

    The function is called as ``reward(prompt: str, completion: str) -> float`` on the decoded
    completion (special tokens removed). The returned wrapper checks that the value is a finite
    number: one NaN reward would turn every advantage of its group, and then the loss, into NaN.
    """
    source, _, attr = spec.rpartition(":")          # rpartition: a Windows path 'C:\...' keeps its colon
    if not source or not attr:
        raise TaskError(f"--reward {spec!r}: expected module:function or path/to/file.py:function")
    try:
        if source.endswith(".py"):
            if not os.path.isfile(source):
                raise FileNotFoundError(f"no file {source}")
            name = "reward_" + os.path.splitext(os.path.basename(source))[0]
            module_spec = importlib.util.spec_from_file_location(name, source)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module              # as a normal import would (dataclasses, pickling need it)
            module_spec.loader.exec_module(module)
        else:
            # `python train.py` puts train.py's folder on sys.path, not the current directory.
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(source)
    except Exception as e:
        raise TaskError(f"--reward {spec!r}: cannot import {source} ({_one_line(e)})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        what = "is not callable" if hasattr(module, attr) else "is not defined"
        raise TaskError(f"--reward {spec!r}: {attr} {what} in {source}; expected def {attr}(prompt, completion) -> float")
    try:
        inspect.signature(fn).bind("prompt", "completion")
    except TypeError:
        raise TaskError(f"--reward {spec!r}: {attr} must take two arguments (prompt, completion)") from None
    except ValueError:
        pass                                        # no inspectable signature (some builtins): trust it

    def reward(prompt: str, completion: str) -> float:
        return real_number(fn(prompt, completion), f"--reward {spec}")

    return reward


def real_number(value, who: str = "the reward") -> float:
    """A reward's value as a float, if it is one finite real number: what float() takes, bool,
    int, float, a NumPy scalar or 0-d array, a 0-d torch tensor (of a real dtype); else a TypeError
    or ValueError naming ``who``: not the string '1.0' (nor bytes), not a sequence or an array of
    several values, not a complex number, and not NaN or inf, which would turn every advantage of
    its group, and then the loss, into NaN."""
    shown = lambda: f"{type(value).__name__} {' '.join(repr(value).split())[:80]}"     # one line
    if getattr(value, "ndim", 0) != 0:
        shape = tuple(getattr(value, "shape", ()))
        raise TypeError(f"{who} returned {type(value).__name__} of shape {shape}, not one number")
    if not one_real(value):
        raise TypeError(f"{who} returned {shown()}, not a number")
    try:
        number = float(value)
    except OverflowError:               # an int beyond float's range
        number = math.inf
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{who} returned {shown()}, not a real number") from None
    if not math.isfinite(number):
        raise ValueError(f"{who} returned {shown()}, not a finite number")
    return number


def one_real(value) -> bool:
    """Whether a value holds one real number (arrays and tensors: of 0 dimensions): a real
    number type, a NumPy or torch value of a real dtype (bool, integer, floating), or anything
    else that converts itself to float (__float__); not text, which float() parses."""
    if isinstance(value, (str, bytes, bytearray)) or getattr(value, "ndim", 0) != 0:
        return False
    dtype = getattr(value, "dtype", None)
    if dtype is not None:               # NumPy: its kind letter; torch: is_complex
        kind = getattr(dtype, "kind", None)
        if kind is not None:
            return kind in ("b", "i", "u", "f")
        return not getattr(dtype, "is_complex", True)
    if isinstance(value, numbers.Complex):
        return isinstance(value, numbers.Real)
    return hasattr(type(value), "__float__")
