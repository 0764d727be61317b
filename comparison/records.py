"""Running compare.py's arms and keeping their records: each arm's train.py flags (arm_flags) and
each run's (own_flags: the replicate's model and seed, the lr, the budget, the eval grid), one
train.py run in a process of its own (run_train; the demo model of its warm start built first,
build_tiny_model), and a finished run's compact record: made from its folder (run_record), kept
under a key of its flags and starting model (record_path, save_record), found again (load_record)
and read at the comparison's eval grid (read_record).
"""
from __future__ import annotations

import gzip
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                # the project's modules (train.py, infra/, ...)

from infra import cli  # noqa: E402
from infra import runfolder  # noqa: E402
import train  # noqa: E402
from stats import CompareError  # noqa: E402

# ---- the arms ----------------------------------------------------------------------------------
ARMS = ("on_policy", "replay", "control")
OPTIONAL_ARMS = ("replay_big", "replay_y3", "replay_y4", "control_y4", "replay_y4_ppo", "replay_pbr", "replay_nonzero",
                 "replay_ppo", "replay_asymre", "replay_cap1", "replay_cap4", "control_nonzero")
FIXED_Y = {"replay_y3": 3, "replay_y4": 4, "control_y4": 4, "replay_y4_ppo": 4}     # arms whose y is their own, whatever --replay-ratio
# --skip-zero-advantage: the arms of the filtered design (S = new stored rollouts per update)
FILTERED_ARMS = ("on_policy", "replay", "replay_big", "control", "replay_y4", "control_y4")


def arm_flags(arm: str, batch: int, y: int, G: int, delta: float, filtered_prompts: int = 0) -> list[str]:
    """train.py flags that define an arm: prompts per round P (R = P*G), buffer N, batch B, extras.
    filtered_prompts P > 0: every arm stores only groups whose rewards differ and updates once S new
    ones are stored (train.py --new-per-update), each round P prompts: S takes R's place below."""
    y = FIXED_Y.get(arm, y)
    if filtered_prompts:
        if arm not in FILTERED_ARMS:
            raise CompareError(f"arm {arm}: not an arm of the filtered design ({', '.join(FILTERED_ARMS)})")
        S, N, B = {"on_policy": (batch, batch, batch), "replay_big": (batch // y, 2 * batch, batch),
                   "control": (batch // y,) * 3, "control_y4": (batch // y,) * 3}.get(arm, (batch // y, batch, batch))
        return ["--prompts-per-round", str(filtered_prompts), "--buffer-size", str(N), "--batch-size", str(B),
                "--skip-zero-advantage", "--new-per-update", str(S)]
    if arm == "on_policy":
        P, N, B = batch // G, batch, batch
    elif arm in ("control", "control_y4"):
        P, N, B = batch // (y * G), batch // y, batch // y
    elif arm == "control_nonzero":          # a queue of kept rollouts, each used once: no eviction before use
        P, N, B = batch // (y * G), batch + batch // y, batch
    else:
        P, N, B = batch // (y * G), 2 * batch if arm == "replay_big" else batch, batch
    extra = {"replay_pbr": ["--keep-correct-frac", str(delta)], "replay_nonzero": ["--skip-zero-advantage"],
             "replay_ppo": ["--loss", "ppo"], "replay_y4_ppo": ["--loss", "ppo"], "replay_asymre": ["--loss", "asymre"],
             "replay_cap1": ["--is-cap", "1.0"], "replay_cap4": ["--is-cap", "4.0"],
             "control_nonzero": ["--skip-zero-advantage", "--no-reuse"]}.get(arm, [])
    return ["--prompts-per-round", str(P), "--buffer-size", str(N), "--batch-size", str(B)] + extra


# ---- the flags of one run ---------------------------------------------------------------------
# train.py flags that --train-args may not hold although compare.py does not set them: why
NOT_PASSED = {"resume": "compare.py starts its own runs",
              "eval_every": "the runs evaluate at token thresholds instead (--evals)",
              "eval_at_tokens": "the runs evaluate at compare.py's grid (--evals, --early-tokens)"}


def train_flags(argv: list[str], prog: str = "compare.py --train-args") -> dict:
    """train.py's flags among argv, read by train.py's own parser: {field: value} of those given.
    A flag train.py does not have, or a bad value, stops here in one line (prog: whose flags)."""
    parser = cli.build_parser(train.Config, explicit_only=True)
    parser.prog = prog
    return vars(parser.parse_args(argv))


def warm_start_seed(args, seed: int) -> int:
    return 0 if args.one_model else seed


def token_grid(args) -> list[int]:
    """The generated-token thresholds every run evaluates at: 0, one interval, ..., the budget; with
    --early-tokens T, --early-evals of them evenly up to T, then --evals evenly from T to the budget."""
    start, grid = 0, []
    for end, evals in ([(args.early_tokens, args.early_evals)] if args.early_tokens else []) + [
            (args.budget_tokens, args.evals)]:
        interval = -(-(end - start) // evals)                          # ceil: the last threshold is the end
        grid += [start + k * interval for k in range(evals) if start + k * interval < end]
        start = end
    return grid + [args.budget_tokens]


def eval_flags(grid: list[int]) -> list[str]:
    """train.py's flags for evals at the grid's thresholds: a uniform grid as --eval-every-tokens (the
    flag of the records before --early-tokens, so they still match), any other as --eval-at-tokens."""
    if grid == [k * grid[1] for k in range(len(grid) - 1)] + [grid[-1]]:
        return ["--eval-every-tokens", str(grid[1])]
    return ["--eval-at-tokens", ",".join(map(str, grid[1:]))]


def own_flags(args, arm: str, seed: int, lr: float, out: str) -> list[str]:
    """The train.py flags compare.py sets for one run (replicate seed of an arm at lr): the arm's,
    the replicate's model and seed, the lr, the budget and the eval grid. A run gets these, then
    --train-args, which may hold none of them (compare.parse refuses it)."""
    model = ["--warm-start-seed", str(warm_start_seed(args, seed))] if args.model == "tiny" else []
    # Every run evaluates when its generated tokens cross the same thresholds: curves line up.
    return arm_flags_of(args, arm) + model + [
        "--seed", str(seed), "--lr", str(lr), "--output-dir", out, "--model", args.model, "--task", args.task,
        "--num-generations", str(args.num_generations), "--max-gen-tokens", str(args.budget_tokens),
        "--max-rounds", str(10**9), *eval_flags(token_grid(args)),
        "--eval-prompts", str(args.eval_prompts), "--no-progress"]


def arm_flags_of(args, arm: str) -> list[str]:
    """arm_flags with the comparison's settings; an arm given by --arm NAME FLAGS: its FLAGS."""
    custom = dict(getattr(args, "arm", None) or [])
    if arm in custom:
        return shlex.split(custom[arm])
    filtered = args.prompts_per_round if getattr(args, "skip_zero_advantage", False) else 0
    return arm_flags(arm, args.batch_size, args.replay_ratio, args.num_generations, args.keep_correct_frac, filtered)


def flags_differ(a: list[str], b: list[str]) -> dict:
    """What two arms' train.py flags set differently: {flag: [a's value, b's value]}, a flag one of
    them does not give at train.py's default (a flag train.py does not know yet: as given, or
    None). What a pair of arms reads is these differences, and nothing else of the arms'."""
    parser = cli.build_parser(train.Config)
    values = []
    for argv in (a, b):
        known, unknown = parser.parse_known_args(argv)
        extra = {}
        for i, x in enumerate(unknown):     # --flag value or --flag: a flag of a newer train.py
            if x.startswith("--"):
                valued = i + 1 < len(unknown) and not unknown[i + 1].startswith("--")
                extra[x[2:].replace("-", "_")] = unknown[i + 1] if valued else True
        values.append({**vars(known), **extra})
    names = sorted(values[0].keys() | values[1].keys())
    return {"--" + k.replace("_", "-"): [values[0].get(k), values[1].get(k)]
            for k in names if values[0].get(k) != values[1].get(k)}


def plain_flags(args) -> list[str]:
    """train.py's own defaults for what a model's defaults (cli.MODEL_DEFAULTS: smollm2 samples at
    temperature 0.7 and stores only groups of mixed rewards) would change and compare.py does not set:
    an arm is its flags, whatever the model. They come first: an arm's flags and --train-args win.
    --record-log-mu is not among them: it changes how log mu is taken, not its values (smollm2's
    runs record it, as its committed records were made)."""
    own = train_flags(own_flags(args, "on_policy", 0, args.lr, "run"))
    flags = []
    kept = {"record_log_mu"}    # engineering, the same samples and log mu: the model's stays
    for name in sorted(cli.MODEL_DEFAULTS.get(args.model, {}).keys() - own.keys() - NOT_PASSED.keys()
                       - kept):
        default, flag = getattr(train.Config, name), "--" + name.replace("_", "-")
        flags += ([flag] if default else ["--no-" + flag[2:]]) if isinstance(default, bool) else [flag, str(default)]
    return flags


# ---- running a run ----------------------------------------------------------------------------
def threads_env(threads: int = 1, **extra: str) -> dict:
    """The environment of a child process with this many torch threads (runs side by side, one
    thread each, do not fight for the cores), and any extra variables."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra}


def build_tiny_model(task: str, warm_start_seed: int, warm_start_steps: int = 0, env: dict | None = None) -> None:
    """The embedded model of one warm start (infra/demo_model.py), built and cached in a process of its own
    (one thread, unless env says otherwise)."""
    subprocess.run([sys.executable, "-m", "infra.demo_model", "--task", task, "--warm-start-seed", str(warm_start_seed),
                    "--warm-start-steps", str(warm_start_steps)], cwd=ROOT, env=env or threads_env(), check=True,
                   stdout=subprocess.DEVNULL)


def run_train(argv: list[str], out: str, env: dict | None = None) -> None:
    """One train.py run in its own process, one torch thread (unless env says otherwise). A finished
    run (done.json with the same flags) is not run again: an interrupted comparison picks up where it
    stopped; a run folder of other flags is run afresh."""
    done = os.path.join(out, "done.json")
    if os.path.exists(done) and json.load(open(done)) == argv:
        return
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    env = env or threads_env()
    with open(os.path.join(out, "log.txt"), "w") as log:
        code = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = open(os.path.join(out, "log.txt")).read().strip().splitlines()[-3:]
        raise RuntimeError(f"train.py {' '.join(argv)} exited with {code}: {' / '.join(tail)}")
    with open(done, "w") as f:
        json.dump(argv, f)


# ---- a run's record ---------------------------------------------------------------------------
# wall_seconds: a loop whose generation and training overlap (async) gives its own wall clock
EVAL_KEYS = ("round", "step", "gen_tokens", "gen_seconds", "train_seconds", "wall_seconds",
             "eval_accuracy")
CPU_KEYS = ("gen_cpu_seconds", "train_cpu_seconds")    # records since 2026-12-02: CPU seconds too
PER_STEP = ("is_ratio_mean", "is_ratio_max", "is_truncated_frac")        # kept per update in a run's record


def run_record(run_dir: str) -> dict:
    """The compact record of a finished run (a few KB), from its folder's metrics.jsonl and
    config.json (record_of)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    return record_of(rows, cfg, run_dir)


def record_of(rows: list[dict], cfg: dict, name: str = "run") -> dict:
    """A run's compact record from its metrics rows and config: its config, its eval rows, the
    entropy of its last 5% of steps and over the second half of its rounds, its staleness over all
    steps (the importance weights truncated, the ages, the importance ratios) and per step
    (PER_STEP), its final counters and its rounds' counts (round_counts); all that read_record
    needs, none of its checkpoints. The rows themselves go beside the record (save_rows)."""
    steps = [r for r in rows if "eval_accuracy" not in r and r.get("updates") != 0]   # nor rounds with none
    if not steps:
        raise CompareError(f"{name}: the run took no optimizer step (its metrics.jsonl has no step "
                           "row): raise the budget, or lower B or S")
    tail = steps[-max(1, len(steps) // 20):]                # entropy: the last 5% of steps
    return {"config": cfg, "evals": [{k: r[k] for k in EVAL_KEYS + CPU_KEYS if k in r}
                                     for r in rows if "eval_accuracy" in r],
            "entropy_tail": [r["rollout_entropy"] for r in tail],
            "staleness": {"truncated_frac": statistics.fmean(r["is_truncated_frac"] for r in steps),
                          "truncated_frac_max": max(r["is_truncated_frac"] for r in steps),
                          "age_mean": statistics.fmean(r["age_mean"] for r in steps),
                          "age_max": max(r["age_max"] for r in steps),
                          "is_ratio_mean": statistics.fmean(r["is_ratio_mean"] for r in steps),
                          "is_ratio_max": max(r["is_ratio_max"] for r in steps)},
            # every update's staleness (skipped ones included), so any sentence about it can be recomputed
            "per_step": {k: [round(r[k], 5) for r in steps] for k in PER_STEP},
            "last": {k: rows[-1][k] for k in ("round", "step", "gen_seconds", "train_seconds")},
            # the measured replay: rollouts generated, stored, trained on; those gone from the buffer by
            # their uses; the ages at which they were trained (runs before these counts: absent)
            **({"reuse": {**{k: rows[-1][k] for k in ("rollouts_generated", "rollouts_stored", "rollouts_trained")},
                          "left_by_uses": next(r["left_by_uses"] for r in reversed(rows) if "left_by_uses" in r),
                          "age_mean": statistics.fmean(r["age_mean"] for r in steps),
                          "age_max": max(r["age_max"] for r in steps)}}
               if "rollouts_stored" in rows[-1] else {}),
            "entropy_second_half": entropy_second_half(rows),
            **({"rounds": round_counts(rows, cfg.get("skip_zero_advantage", False))}
               if "rollouts_stored" in rows[-1] else {})}


def round_rows(rows: list[dict]) -> list[dict]:
    """The last row of each round (a step's, or a round's without one), in order: the loop's
    counters after that round, and the round's own figures (rollout_entropy, zero_adv_frac, ...)."""
    last = {}
    for r in rows:
        if "eval_accuracy" not in r and "rollout_entropy" in r:
            last[r["round"]] = r
    return [last[k] for k in sorted(last)]


def entropy_second_half(rows: list[dict]) -> float:
    """The mean rollout entropy of the rounds generated in the second half of the run's tokens (the
    rounds whose token count passes half the last one), each round once: a figure of many rounds,
    not of the last few steps."""
    rounds = round_rows(rows)
    half = [r["rollout_entropy"] for r in rounds if r["gen_tokens"] > rounds[-1]["gen_tokens"] / 2]
    return statistics.fmean(half) if half else math.nan


def round_counts(rows: list[dict], skip_zero_advantage: bool) -> dict:
    """What the run's rounds did with what they generated, from each round's counters: rollouts
    generated, of zero advantage (with the filter: not stored; the round's zero_adv_frac x its
    rollouts, exact for 0/1 rewards, where a mixed group has none of zero advantage), stored, and
    discarded (generated - zero advantage - stored: the synchronous loop's cap, train.py stores at
    most the S an update waits for); the rounds, those that stored nothing (empty), those that
    discarded some, and the optimizer steps."""
    totals = dict.fromkeys(("rounds", "empty_rounds", "discard_rounds", "generated",
                            "zero_advantage", "stored", "discarded", "steps"), 0)
    before = {"rollouts_generated": 0, "rollouts_stored": 0}
    rounds = round_rows(rows)
    if skip_zero_advantage and any("zero_adv_frac" not in r for r in rounds):
        raise CompareError("a round's row has no zero_adv_frac: its zero-advantage rollouts and "
                           "discards cannot be told apart")
    for r in rounds:
        generated = r["rollouts_generated"] - before["rollouts_generated"]
        stored = r["rollouts_stored"] - before["rollouts_stored"]
        zero = round(r["zero_adv_frac"] * generated) if skip_zero_advantage else 0
        discarded = generated - zero - stored
        totals["rounds"] += 1
        totals["empty_rounds"] += stored == 0
        totals["discard_rounds"] += discarded > 0
        for k, v in (("generated", generated), ("zero_advantage", zero), ("stored", stored),
                     ("discarded", discarded)):
            totals[k] += v
        before = r
    totals["steps"] = rows[-1]["step"]
    return totals


def rows_path(record_path: str) -> str:
    """Where a record's metrics rows lie: beside it, <record>.metrics.jsonl.gz."""
    return record_path[:-len(".json")] + ".metrics.jsonl.gz"


def save_rows(record_path: str, run_dir: str) -> None:
    """The run's metrics.jsonl, every row, gzipped beside its record (the same bytes always give
    the same file: no name or time in the gzip header), so that its rounds can be counted again."""
    with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as f:
        data = f.read()
    tmp = rows_path(record_path) + ".tmp"
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as out:
        out.write(data)
    os.replace(tmp, rows_path(record_path))


def read_rows(record_path: str) -> list[dict]:
    """The metrics rows kept beside a record (save_rows)."""
    with gzip.open(rows_path(record_path), "rt") as f:
        return [json.loads(line) for line in f]


def discards_possible(argv: list[str]) -> bool | None:
    """Whether the synchronous loop can throw away rollouts a run of these train.py flags generated:
    with S (--new-per-update) train.py stores at most S - the new ones already stored. A round
    stores a multiple of u (G with the zero-advantage filter: whole groups; without it P x G), so
    before a round at most u (ceil(S / u) - 1) new ones are stored and it has room for at least
    r = S - u (ceil(S / u) - 1); discards are possible when r < P x G. None lost: with the filter,
    P = 1 and S a multiple of G; without it, S a multiple of P x G. None: an async run
    (--generators), whose rounds this rule does not cover."""
    known, unknown = cli.build_parser(train.Config).parse_known_args(argv)
    cfg = vars(known)
    if "generators" not in cfg:             # a train.py before --generators: the flag as given
        cfg["generators"] = int(flags_differ(argv, []).get("--generators", [0])[0])
    if cfg["generators"]:
        return None
    S, P, G = cfg["new_per_update"], cfg["prompts_per_round"], cfg["num_generations"]
    if not S:
        return False
    u = G if cfg["skip_zero_advantage"] else P * G
    return S - u * (-(-S // u) - 1) < P * G


def record_argv(argv: list[str]) -> list[str]:
    """A run's flags without its output folder: a record stands for the run on any machine."""
    i = argv.index("--output-dir")
    return argv[:i] + argv[i + 2:]


def starting_model(model: str, task: str, warm_start_seed: int, warm_start_steps: int = 0) -> str:
    """What a run starts from, as a record keeps it: a hub id or folder as given; the embedded model
    by its spec's hash (demo_model.spec): the same flags name another model once its warm start changes."""
    if model != "tiny":
        return model
    from infra import demo_model
    import tasks
    task_ = tasks.load_task(task)
    return os.path.basename(demo_model.cache_path(task_, demo_model.spec(task_, warm_start_steps or None, warm_start_seed)))


def record_path(records: str, name: str, argv: list[str], model: str) -> str:
    """Where a run's record lies: records/<arm>/seed<i>-<key>.json, the key a hash of everything that
    makes the run what it is (its flags, the lr included, and its starting model), so that a run with
    other flags never overwrites the record another summary was computed from."""
    import hashlib
    key = hashlib.sha256(json.dumps([record_argv(argv), model]).encode()).hexdigest()[:10]
    return os.path.join(records, f"{name}-{key}.json")


def load_record(path: str, argv: list[str], model: str, threads: int = 1) -> dict | None:
    """The record at path if it is of a run with these flags from this starting model, on as many
    torch threads (a record without the count ran on one), else None: the run is due."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        record = json.load(f)
    same = record.get("argv") == record_argv(argv) and record.get("model") == model
    return record if same and record.get("threads", 1) == threads else None


def save_record(path: str, record: dict) -> None:
    """Written whole or not at all (a temporary file, then renamed)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    runfolder.write_json(path, record, indent=1)


def read_record(record: dict, grid: list[float], name: str = "run") -> dict:
    """A run's evals at the grid of token thresholds (at each g: its first eval with generated tokens
    >= g): accuracy, tokens, seconds (generation + training), rounds and steps, with its round size R
    and batch B (rollouts generated = rounds x R, trained = steps x B)."""
    cfg, evals, last = record["config"], record["evals"], record["last"]
    R, B = cfg["prompts_per_round"] * cfg["num_generations"], cfg["batch_size"]
    picks = [next(r for r in evals if r["gen_tokens"] >= g) for g in grid]
    for a, b, g, before in zip(picks, picks[1:], grid[1:], grid):
        if a is b:      # one eval would count twice in the smoothing (a lucky one could set the target)
            raise CompareError(f"{name}: the eval at {a['gen_tokens']:,} tokens stands for the grid points "
                               f"below and at {g:,}: one round generated more tokens than the eval interval "
                               f"({g - before:,}); raise --budget-tokens or --early-tokens, or lower --evals "
                               f"or --early-evals")
    tail = record["entropy_tail"]
    return {
        "tokens": [r["gen_tokens"] for r in picks],
        # wall seconds of generation and training (evals excluded): the loop's own clock where
        # they overlap (async), else their sum
        "seconds": [r.get("wall_seconds", r["gen_seconds"] + r["train_seconds"]) for r in picks],
        # CPU seconds of generation + training (NaN in records older than them)
        "cpu_seconds": [r["gen_cpu_seconds"] + r["train_cpu_seconds"] if "gen_cpu_seconds" in r else math.nan
                        for r in picks],
        "rounds": [r["round"] for r in picks], "steps": [r["step"] for r in picks],
        "accuracy": [r["eval_accuracy"] for r in picks],
        "entropy": statistics.mean(tail) if tail else float("nan"), "R": R, "B": B,
        **({"entropy_half": record["entropy_second_half"]}
           if "entropy_second_half" in record else {}),
        **({"rounds_counted": record["rounds"]} if "rounds" in record else {}),
        "gen_seconds": last["gen_seconds"], "train_seconds": last["train_seconds"],
        "rollouts_generated": last["round"] * R, "rollouts_trained": last["step"] * B,
        **record.get("staleness", {}),          # records written before 2026-12-01 have none (or no ratios)
        **({"reuse": record["reuse"]} if "reuse" in record else {}),
    }
