"""Every flag does what it says, or is refused.

The flags of each entry point are read from its parser: train.py, train.py --resume, evaluate.py,
compare.py, and every train.py flag passed through compare.py's --train-args; minimal.main's
keyword arguments from its signature. Each has a line in a table below that says where its value
goes. The test gives it a value other than its default and checks that the value reached what the
entry point writes (config.json, each compare run's config, summary.json, eval.json), or that the
entry point refused it: exit code 2, one line naming the flag, before any model was built or
loaded. A flag without a line fails: a new flag is covered by writing its line.

Nothing is trained. loading.load_model is stood in for (train.py writes config.json before it, for
real); compare.py's runs are read by train.py's parser (conftest.py: compare_runs); evaluate.py's
scores are made up; minimal.main's model calls are recorded.
"""
import argparse
import functools
import glob
import inspect
import json
import os
import random
import shlex
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from infra import cli

import compare
import evaluate
from infra import loading
import minimal
from infra import report
import summaries
import tasks
import train
from conftest import cost_file

CONFIG, REFUSED = "config", "refused"


def table(text: str) -> dict:
    """{field: (the flag and a value other than its default, its line in each of CONTEXTS, the words
    its --help must hold)} from the rows of a table whose columns are split by |."""
    rows = [[cell.strip() for cell in line.split("|")] for line in text.strip().splitlines()[1:]]
    return {row[0]: (row[1], tuple(row[2:5]), row[5]) for row in rows}


# Where a train.py flag's value goes: config (it reaches config.json: train.py's, or each run's in
# compare.py), or refused (one line, exit code 2, before any model). --resume: of a run saved with
# the defaults; compare: through compare.py --train-args, its default arms. The last column: where
# the value acts only in some cases, the words of its --help that say which.
TRAIN = table("""
field                  | flag and value                 | train.py | --resume | compare | acts only
model                  | --model my/model               | config   | refused  | refused |
warm_start_steps       | --warm-start-steps 300         | config   | refused  | config  | tiny model only
warm_start_seed        | --warm-start-seed 3            | config   | refused  | refused | tiny model only
task                   | --task addition3               | config   | refused  | refused |
reward_mode            | --reward-mode lenient          | config   | refused  | config  | GSM8K-format
reward                 | --reward {tmp}/reward.py:exact | config   | refused  | config  |
chat_template          | --no-chat-template             | config   | refused  | config  | when it has one
system_prompt          | --system-prompt 'Be brief.'    | config   | refused  | config  | with the chat template
output_dir             | --output-dir {tmp}/out         | config   | refused  | refused |
seed                   | --seed 7                       | config   | refused  | refused |
prompts_per_round      | --prompts-per-round 8          | config   | refused  | refused |
num_generations        | --num-generations 4            | config   | refused  | refused |
max_new_tokens         | --max-new-tokens 20            | config   | config   | config  |
temperature            | --temperature 0.7              | config   | refused  | config  |
top_p                  | --top-p 0.9                    | refused  | refused  | refused |
buffer_size            | --buffer-size 512              | config   | refused  | refused |
batch_size             | --batch-size 128               | config   | config   | refused |
updates_per_round      | --updates-per-round 2          | config   | config   | config  |
max_age                | --max-age 3                    | config   | config   | config  |
reuse                  | --no-reuse                     | config   | config   | config  |
keep_correct_frac      | --keep-correct-frac 0.25       | config   | config   | config  |
correct_reward         | --correct-reward 10            | config   | config   | config  | with --keep-correct-frac
skip_zero_advantage    | --skip-zero-advantage          | config   | config   | config  |
new_per_update         | --new-per-update 128           | config   | config   | config  |
learning_starts        | --learning-starts 128          | config   | config   | config  | synchronous loop
loss                   | --loss ppo                     | config   | config   | config  |
asymre_tau             | --asymre-tau 0.2               | config   | config   | config  | of the asymre loss
is_cap                 | --is-cap 3                     | config   | config   | config  | (tis)
epsilon                | --epsilon 0.3                  | config   | config   | config  | of the ppo loss
normalization          | --normalization sequence_mean  | config   | config   | config  |
lr                     | --lr 5e-4                      | config   | config   | refused |
max_grad_norm          | --max-grad-norm 0.5            | config   | config   | config  |
lora_r                 | --lora-r 8                     | config   | refused  | config  |
lora_alpha             | --lora-alpha 16                | config   | refused  | config  |
micro_batch_size       | --micro-batch-size 4           | config   | config   | config  |
beta                   | --beta 0.05                    | config   | config   | config  |
max_rounds             | --max-rounds 3                 | config   | config   | refused |
max_gen_tokens         | --max-gen-tokens 1000          | config   | config   | refused |
eval_every             | --eval-every 5                 | config   | config   | refused | unless --eval-every-tokens
eval_every_tokens      | --eval-every-tokens 1000       | config   | config   | refused |
eval_at_tokens         | --eval-at-tokens 500,1000      | config   | config   | refused |
eval_prompts           | --eval-prompts 50              | config   | config   | refused |
device                 | --device cpu                   | config   | config   | config  |
progress               | --no-progress                  | config   | config   | refused |
plot                   | --no-plot                      | config   | config   | config  |
report_to              | --report-to tensorboard        | config   | config   | config  |
dtype                  | --dtype float16                | config   | config   | config  |
load_in_4bit           | --load-in-4bit                 | config   | refused  | config  |
gradient_checkpointing | --gradient-checkpointing       | config   | config   | config  |
record_log_mu          | --record-log-mu                | config   | config   | config  |
fast_generation        | --fast-generation              | config   | config   | config  |
logp_chunk             | --logp-chunk 64                | config   | config   | config  | Llama/Qwen
shared_prefix          | --shared-prefix                | config   | config   | config  |
trust_remote_code      | --trust-remote-code            | config   | config   | config  |
generators             | --generators 2                 | config   | config   | config  |
generator_devices      | --generator-devices cpu --generators 1 | config | config | config | default: the trainer's
sync_every             | --sync-every 2                 | config   | config   | config  | to the workers
max_lag                | --max-lag 1 --sync-every 3 --generators 1 --step-when-held | config | config | config | a worker
step_when_held         | --step-when-held --generators 1 | config  | config   | config  | with --generators
lockstep               | --lockstep --generators 1      | config   | config   | config  | with --generators
max_uses               | --max-uses 2                   | config   | config   | config  | with --step-when-held
worker_timeout         | --worker-timeout 5             | config   | config   | config  | with --generators
save_every             | --save-every 2                 | config   | config   | config  |
keep_checkpoints       | --keep-checkpoints 3           | config   | config   | config  |
resume                 | --resume {ckpt}                | config   | config   | refused |
on_reward_error        | --on-reward-error zero         | config   | config   | config  |
reward_timeout         | --reward-timeout 5             | config   | config   | config  |
max_skipped_steps      | --max-skipped-steps 3          | config   | config   | config  |
""")
CONTEXTS = ("train.py", "train.py --resume", "compare.py --train-args")

# compare.py's own flags: cases (flags, then a check of what it wrote, or REFUSED). w.summary:
# summary.json; w.each(field): the values of a field over the runs' configs; w.arm(name): its configs.
COMPARE = {
    "output_dir": [("--output-dir {tmp}/elsewhere",
                    lambda w: all(c.output_dir.startswith(f"{w.tmp}/elsewhere/") for _, c in w.runs))],
    "budget_tokens": [("--budget-tokens 6000",
                       lambda w: w.summary["budget_tokens"] == 6000 and w.each("max_gen_tokens") == {6000})],
    "seeds": [("--seeds 2", lambda w: w.each("seed") == {0, 1}
               and {a["seeds"] for a in w.summary["arms"].values()} == {2})],
    "first_seed": [("--first-seed 100 --seeds 2", lambda w: w.each("seed") == {100, 101}
                    and w.summary["replicates"].endswith("(i from 100)")),
                   ("--first-seed -1", REFUSED)],
    "one_model": [("--one-model --seeds 2", lambda w: w.each("warm_start_seed") == {0} and w.each("seed") == {0, 1}
                   and w.summary["replicates"].startswith("one model"))],
    "jobs": [("--jobs 3", lambda w: w.spied["jobs"] == [3] and "3 run(s) side by side" in w.summary["seconds_measured"])],
    "threads": [("--threads 2", lambda w: {e["OMP_NUM_THREADS"] for e in w.envs} == {"2"}
                 and "2 torch threads each" in w.summary["seconds_measured"]),
                ("--threads 0", REFUSED)],
    "batch_size": [("--batch-size 128", lambda w: {c.batch_size for c in w.arm("on_policy")} == {128})],
    "replay_ratio": [("--replay-ratio 4", lambda w: {c.rollouts_per_round for c in w.arm("replay")} == {256 // 4})],
    "num_generations": [("--num-generations 4", lambda w: w.each("num_generations") == {4})],
    "lr": [("--lr 2e-3", lambda w: w.each("lr") == {2e-3} and set(w.summary["lr"].values()) == {2e-3})],
    "sweep_lr": [("--sweep-lr 5e-4 2e-3",
                  lambda w: w.each("lr") == {5e-4, 2e-3} and w.summary["lr_chosen_by"] == "sweep"),
                 ("--sweep-lr", REFUSED)],
    "sweep_seeds": [("--sweep-lr 1e-3 --sweep-seeds 3",
                     lambda w: w.summary["lr_sweep"]["seeds"] == [1000, 1001, 1002]),
                    ("--sweep-seeds 3", REFUSED)],
    "arms": [("--arms on_policy control", lambda w: set(w.summary["arms"]) == {"on_policy", "control"})],
    "keep_correct_frac": [("--arms on_policy replay_pbr --keep-correct-frac 0.4",
                           lambda w: {c.keep_correct_frac for c in w.arm("replay_pbr")} == {0.4}),
                          ("--keep-correct-frac 0.4", REFUSED)],
    "cost": [("--cost {tmp}/cost.json", lambda w: w.summary["cost"]["file"].endswith("/cost.json")
              and all(a["projected_seconds_to_target"]["plain"]["seconds"] == pytest.approx(   # the file's curve
                  a["rounds_to_target"] * a["R"] / 100 + a["steps_to_target"] * a["B"] / 200)
                  for a in w.summary["arms"].values())),
             ("--cost {tmp}/reward.py", REFUSED)],
    "records": [("--records {tmp}/rec", lambda w: len(glob.glob(f"{w.tmp}/rec/replay/seed0-*.json")) == 1)],
    # --summary runs nothing and writes nothing: its answer is checked in test_compare (decide)
    "summary": [("--summary {tmp}/reward.py", REFUSED)],
    "bootstrap": [("--bootstrap 20", lambda w: w.spied["bootstrap"] == [20] and "(20 resamples)" in w.summary["intervals"])],
    "target_frac": [("--target-frac 0.9", lambda w: w.summary["target_frac"] == 0.9 and w.summary["target_accuracy"]
                     == pytest.approx(compare.target_accuracy(w.on_policy_runs, 0.9)))],
    "target": [("--target 0.3", lambda w: w.summary["target_accuracy"] == 0.3
                and w.summary["target_fixed"] and w.summary["target_accuracy_ci"] == [0.3, 0.3]),
               ("--target 1.5", REFUSED), ("--target 0.3 --target-frac 0.9", REFUSED)],
    "target_rule": [("--target-rule first", lambda w: w.summary["target_rule"] == "first")],
    "arm": [("--arms on_policy wide --arm wide '--prompts-per-round 4 --buffer-size 32 "
             "--batch-size 32'",
             lambda w: {(c.prompts_per_round, c.batch_size) for c in w.arm("wide")} == {(4, 32)}),
            ("--arms on_policy wide --arm wide '--prompts-per-round 4'", REFUSED)],
    "pairs": [("--pairs control:replay",
               lambda w: "replay" in w.summary["arms"]["control"]["vs_other"]),
              ("--pairs replay:replay_big", REFUSED)],
    "evals": [("--evals 4", lambda w: len(w.summary["grid_tokens"]) == 5
               and w.each("eval_every_tokens") == {w.summary["grid_tokens"][1]})],
    "early_tokens": [("--early-tokens 2000 --early-evals 4",
                      lambda w: w.summary["grid_tokens"][:5] == [0, 500, 1000, 1500, 2000]
                      and len(w.summary["grid_tokens"]) == 4 + 3 + 1
                      and w.each("eval_at_tokens") == {",".join(map(str, w.summary["grid_tokens"][1:]))}
                      and w.each("eval_every_tokens") == {0}),
                     ("--early-tokens 99999999", REFUSED)],
    "early_evals": [("--early-evals 4", REFUSED)],          # without --early-tokens
    "skip_zero_advantage": [("--skip-zero-advantage --batch-size 64 --num-generations 4",
                             lambda w: w.each("skip_zero_advantage") == {True}
                             and {c.new_per_update for c in w.arm("on_policy")} == {64}
                             and {c.new_per_update for c in w.arm("replay")} == {32}
                             and w.each("prompts_per_round") == {4}),
                            ("--skip-zero-advantage --arms on_policy replay_pbr", REFUSED)],
    "prompts_per_round": [("--skip-zero-advantage --prompts-per-round 2 --batch-size 64 --num-generations 4",
                           lambda w: w.each("prompts_per_round") == {2}),
                          ("--prompts-per-round 2", REFUSED)],      # without --skip-zero-advantage
    "gen_shares": [("--gen-shares 0.9", lambda w: "gen_share_projection" in w.summary and all(
                        set(a["projected_seconds_to_target"]) == {"gen share 90%"} for a in w.summary["arms"].values())),
                   ("--gen-shares 1.5", REFUSED)],
    "eval_prompts": [("--eval-prompts 100", lambda w: w.each("eval_prompts") == {100})],
    "model": [("--model Qwen/Qwen2.5-0.5B-Instruct",
               lambda w: w.each("model") == {"Qwen/Qwen2.5-0.5B-Instruct"} and w.builds == [])],
    "task": [("--task addition3",
              lambda w: w.each("task") == {"addition3"} and {b[0] for b in w.builds} == {"addition3"})],
    "quick": [("--quick", lambda w: w.summary["budget_tokens"] == 5_000 and w.each("eval_prompts") == {100})],
    "train_args": "each train.py flag: TRAIN's compare column",
}
COMPARE_BASE = ["--seeds", "1", "--evals", "3", "--bootstrap", "10", "--jobs", "1"]   # small; the cases override

# evaluate.py's flags: cases (the command line, then a check of the eval.json it wrote, or REFUSED)
EVALUATE = {
    "path": [("{run}", lambda w: w.eval["adapter"] == f"{w.run}/adapter" and w.eval_path == f"{w.run}/eval.json")],
    "checkpoint": [("{run} --checkpoint 1", lambda w: w.eval["adapter"] == f"{w.run}/checkpoint-1/adapter")],
    "model": [("{run} --model Qwen/Qwen2.5-0.5B-Instruct", lambda w: w.eval["model"] == "Qwen/Qwen2.5-0.5B-Instruct")],
    "task": [("{run} --task addition3", lambda w: w.eval["task"] == "addition3")],
    "eval_prompts": [("{run} --eval-prompts 7", lambda w: w.eval["eval_prompts"] == 7)],
    "num_generations": [("{run} --num-generations 4", lambda w: w.eval["num_generations"] == 4 and "pass@4" in w.eval)],
    "temperature": [("{run} --num-generations 4 --temperature 0.7", lambda w: w.eval["temperature"] == 0.7),
                    ("{run} --temperature 0.7", REFUSED)],
    "output": [("{run} --output {tmp}/scores.json", lambda w: w.eval_path == f"{w.tmp}/scores.json")],
    "device": [("{run} --device mps", lambda w: w.eval["device"] == "mps")],
}

# minimal.main's keyword arguments: (the value, given what is recorded; a check of what it did)
MINIMAL = {
    "rounds": (lambda w: 3, lambda w: len(w.generated) == 3 and len(w.result) == 2),
    "eval_every": (lambda w: 10, lambda w: len(w.evaluated) == 11),                # rounds 0, 10, ..., 100
    "eval_prompts": (lambda w: 7, lambda w: set(w.evaluated) == {7}),
    "seed": (lambda w: 5, lambda w: w.seeded == 5 and w.generated[0] == random.Random(5).sample(
        tasks.addition_task(2).train_prompts, minimal.P)),
    "log": (lambda w: w.lines.append, lambda w: w.lines[0] == "round 0: held-out accuracy 0.250"),
}


def flags(parser) -> dict:
    """{dest: its flag (the first option string; a positional's name)} of each action but --help."""
    return {a.dest: a.option_strings[0] if a.option_strings else a.dest
            for a in parser._actions if not isinstance(a, argparse._HelpAction)}


TRAIN_FLAGS, COMPARE_FLAGS = flags(cli.build_parser(train.Config)), flags(compare.build_parser())
EVALUATE_FLAGS, MINIMAL_ARGS = flags(evaluate.build_parser()), list(inspect.signature(minimal.main).parameters)
TRAIN_HELP = {a.dest: " ".join(a.help.split()) for a in cli.build_parser(train.Config)._actions}


def test_every_flag_has_a_line_and_every_line_a_flag():
    for name, found, table in (("train.py", TRAIN_FLAGS, TRAIN), ("compare.py", COMPARE_FLAGS, COMPARE),
                               ("evaluate.py", EVALUATE_FLAGS, EVALUATE), ("minimal.main", MINIMAL_ARGS, MINIMAL)):
        assert set(found) == set(table), (name, "no line:", sorted(set(found) - set(table)),
                                          "no flag:", sorted(set(table) - set(found)))
    for dest, (text, *_) in TRAIN.items():      # each line gives its own flag (--x or --no-x)
        assert text.split()[0] in (TRAIN_FLAGS[dest], TRAIN_FLAGS[dest].replace("--", "--no-", 1)), dest
    for table, found in ((COMPARE, COMPARE_FLAGS), (EVALUATE, EVALUATE_FLAGS)):
        for dest, cases in table.items():
            assert isinstance(cases, str) or all(dest == "path" or found[dest] in text.split() for text, _ in cases)


class Loaded(Exception):
    """loading.load_model was reached (every check before any model passed) and config.json written."""


load_task = tasks.load_task


@functools.cache
def cached_task(name, reward_mode="strict"):
    return load_task(name, reward_mode)


@pytest.fixture
def world(tmp_path, monkeypatch, request):
    """The folder the commands run in (with a reward file), loading.load_model stood in for (it
    records the config and stops), the folders config.json is written to, tasks built once a
    session, and {tmp} / {run} / {ckpt} (a saved run, made on first use) for the command lines."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reward.py").write_text("def exact(prompt, completion):\n    return 1.0\n")
    cost_file(tmp_path / "cost.json", lambda R: R / 100, lambda B: B / 200, sizes=(16, 512))   # comparison/cost.py's
    monkeypatch.setattr(tasks, "load_task", cached_task)
    w = types.SimpleNamespace(tmp=str(tmp_path), loaded=[], stop=False)

    def load_model(cfg, task, *args, **kwargs):         # no model: train.py goes on to write config.json
        w.loaded.append(cfg)
        w.stop = True
        return torch.nn.Linear(1, 1), None, task

    def save_config(run_dir, config):                   # the config as the run keeps it; then stop that run
        w.run_dirs.append(run_dir)
        report_save_config(run_dir, config)
        if w.stop:
            w.stop = False
            raise Loaded(config)
    monkeypatch.setattr(loading, "load_model", load_model)
    report_save_config, w.run_dirs = report.save_config, []
    monkeypatch.setattr(report, "save_config", save_config)

    def fill(text):
        if "{run}" in text or "{ckpt}" in text:
            w.run = request.getfixturevalue("saved_run")
        run = getattr(w, "run", "")
        return text.format(tmp=w.tmp, run=run, ckpt=os.path.join(run, "checkpoint-1"))
    w.fill = fill
    return w


def assert_refused(call, flag: str, capsys, *nothing_done):
    """call() exits with code 2 and one line naming flag; nothing_done (lists of what was loaded,
    built or run) stay empty."""
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err.strip().splitlines()
    names = flag.split() if flag.startswith("--train-args ") else [flag]  # its prog and its flag
    assert e.value.code == 2 and len(err) == 1 and all(n in err[0] for n in names), err
    assert not any(nothing_done), nothing_done


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("dest", sorted(TRAIN_FLAGS))
def test_a_train_flag_reaches_the_config_or_is_refused(dest, context, world, capsys, request):
    assert dest in TRAIN, f"{TRAIN_FLAGS[dest]}: no line in TRAIN (tests/test_flags.py); add one"
    text, lines, only = TRAIN[dest]
    line, flag = lines[CONTEXTS.index(context)], "--" + dest.replace("_", "-")
    assert line in (CONFIG, REFUSED), (dest, line)
    assert only in TRAIN_HELP[dest], f"{flag}: its --help should say where it acts ({only!r})"
    argv = shlex.split(world.fill(text))
    try:                                          # as typed (a refused choice: at parsing)
        value = vars(cli.build_parser(train.Config, explicit_only=True).parse_args(argv))[dest]
    except SystemExit:
        assert line == REFUSED, (dest, "refused at parsing")
        value = None
        capsys.readouterr()
    if "--report-to tensorboard" in text:         # cli refuses it when tensorboard is missing
        request.getfixturevalue("optional")("tensorboard", "--report-to tensorboard")
    if context == "compare.py --train-args":
        runs = request.getfixturevalue("compare_runs")
        call = lambda: compare.main(["--output-dir", f"{world.tmp}/cmp"] + COMPARE_BASE
                                    + [f"--train-args={world.fill(text)}"])     # '=': a lone --x is a flag
        if line == REFUSED:
            return assert_refused(call, f"--train-args {flag}", capsys, runs.runs, runs.builds)
        call()
        assert len(runs.runs) == len(compare.ARMS) and {getattr(c, dest) for _, c in runs.runs} == {value}
        return
    if context == "train.py --resume":
        argv = ["--resume", world.fill("{run}")] + argv
    if line == REFUSED:
        return assert_refused(lambda: train.main(argv), flag, capsys, world.loaded)
    with pytest.raises(Loaded):
        train.main(argv)
    with open(os.path.join(world.run_dirs[-1], "config.json")) as f:
        assert json.load(f)[dest] == value


@pytest.mark.parametrize("dest", sorted(COMPARE_FLAGS))
def test_a_compare_flag_reaches_the_summary_or_the_runs_or_is_refused(dest, world, compare_runs, capsys):
    assert dest in COMPARE, f"compare.py {dest}: no line in COMPARE (tests/test_flags.py); add one"
    if isinstance(COMPARE[dest], str):
        return                                      # --train-args: test_a_train_flag_reaches_the_config_...
    for text, check in COMPARE[dest]:
        compare_runs.runs.clear(), compare_runs.builds.clear(), compare_runs.envs.clear()
        argv = ["--output-dir", f"{world.tmp}/cmp"] + COMPARE_BASE + shlex.split(world.fill(text))
        if check == REFUSED:
            assert_refused(lambda: compare.main(argv), COMPARE_FLAGS[dest], capsys, compare_runs.runs,
                           compare_runs.builds)
            continue
        spied, bootstrap = {"jobs": [], "bootstrap": []}, summaries.bootstrap
        with pytest.MonkeyPatch.context() as m:        # what compare.main passes on: the pool's size, the resamples
            m.setattr(compare, "ThreadPoolExecutor", lambda n: spied["jobs"].append(n) or ThreadPoolExecutor(n))
            m.setattr(summaries, "bootstrap", lambda results, n, *a, **k: spied["bootstrap"].append(n) or bootstrap(
                results, n, *a, **k))
            compare.main(argv)
        folder = compare.build_parser().parse_args(argv).output_dir
        with open(os.path.join(folder, "summary.json")) as f:
            summary = json.load(f)
        runs = list(compare_runs.runs)
        arm_of = lambda out: os.path.basename(os.path.dirname(out))            # OUT/<arm>/seed<i>
        w = types.SimpleNamespace(tmp=world.tmp, summary=summary, runs=runs, builds=compare_runs.builds, spied=spied,
                                  envs=[e for e in compare_runs.envs if e is not None],
                                  on_policy_runs=[{k: v for k, v in r.items() if k != "reach"}
                                                  for r in summary["arms"]["on_policy"]["replicates"]],
                                  each=lambda field: {getattr(c, field) for _, c in runs},
                                  arm=lambda name: [c for out, c in runs if arm_of(out) == name])
        assert check(w), (text, summary)


@pytest.mark.parametrize("dest", sorted(EVALUATE_FLAGS))
def test_an_evaluate_flag_reaches_eval_json_or_is_refused(dest, world, capsys, monkeypatch):
    from infra import checkpoint, generation
    assert dest in EVALUATE, f"evaluate.py {dest}: no line in EVALUATE (tests/test_flags.py); add one"

    def load_model(cfg, task, device, rank):
        world.loaded.append(cfg)
        return types.SimpleNamespace(eval=lambda: None), None, task
    monkeypatch.setattr(loading, "load_model", load_model)
    monkeypatch.setattr(checkpoint, "load_adapter", lambda model, folder: None)
    monkeypatch.setattr(generation, "greedy_rewards", lambda model, tok, prompts, fns, **k: dict.fromkeys(fns, 0.5))
    monkeypatch.setattr(evaluate, "sampled_rewards", lambda model, tok, prompts, reward, *, n, **k:
                        [[1.0] + [0.0] * (n - 1) for _ in prompts])
    for text, check in EVALUATE[dest]:
        world.loaded.clear()
        argv = shlex.split(world.fill(text))
        if check == REFUSED:
            assert_refused(lambda: evaluate.main(argv), EVALUATE_FLAGS[dest], capsys, world.loaded)
            continue
        result = evaluate.main(argv)
        path = (evaluate.build_parser().parse_args(argv).output
                or os.path.join(os.path.dirname(result["adapter"]), "eval.json"))
        with open(path) as f:
            written = json.load(f)
        assert written == result and check(types.SimpleNamespace(eval=written, eval_path=path, run=world.run,
                                                                 tmp=world.tmp)), (text, written)


@pytest.mark.parametrize("name", MINIMAL_ARGS)
def test_a_minimal_argument_does_what_it_says(name, monkeypatch, capsys):
    """minimal.main writes nothing: what it did is read from the calls it made (no model)."""
    assert name in MINIMAL, f"minimal.main({name}=...): no line in MINIMAL (tests/test_flags.py); add one"
    w = types.SimpleNamespace(generated=[], evaluated=[], lines=[], seeded=None)

    def loaded(path):
        w.seeded = torch.initial_seed()
        model = torch.nn.Linear(1, 1)
        model.generation_config = types.SimpleNamespace(eos_token_id=None)    # end_ids reads it
        return model

    monkeypatch.setattr(minimal, "AutoTokenizer", types.SimpleNamespace(
        from_pretrained=lambda path: types.SimpleNamespace(pad_token_id=0, eos_token_id=1)))
    monkeypatch.setattr(minimal, "AutoModelForCausalLM", types.SimpleNamespace(
        from_pretrained=loaded))
    monkeypatch.setattr(minimal, "get_peft_model", lambda base, config: base)
    monkeypatch.setattr(minimal, "evaluate", lambda model, tok, prompts, reward_fn, new_tokens:
                        (w.evaluated.append(len(prompts)), 0.25)[1])
    monkeypatch.setattr(minimal, "generate_rollouts", lambda model, tok, prompts, reward_fn, **kw:
                        (w.generated.append(prompts), ([], 0.0))[1])
    value, check = MINIMAL[name]
    w.result = minimal.main(**{name: value(w)})
    assert check(w), name


def test_help_shows_each_on_off_flag_s_default(capsys):
    """Four readers found --help silent on the defaults of its on/off flags (--reuse,
    --shared-prefix, ...): each now says '(default: on)' or '(default: off)', as its Config has it."""
    import dataclasses
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    flags = [f for f in dataclasses.fields(train.Config) if isinstance(f.default, bool)]
    assert len(flags) >= 12
    for f in flags:
        help_text = " ".join(f.metadata["help"].split())
        assert f"{help_text} (default: {'on' if f.default else 'off'})" in text, f.name
