"""The update alone with each distinct prompt run once (infra/shared_prefix.py's shared_prefix_logp)
against the plain forward, side by side in one process, one thread, the arms' order rotated every
round so that a load on the machine falls on all alike; and how often a batch drawn from the
buffer shares its prompts. Writes docs/results/shared_prefix_cpu.json.

    python benchmarks/shared_prefix.py --quiet-cores        # SmolLM2, about 10 min, one thread
    python benchmarks/shared_prefix.py --model tiny --rounds 1 --output /tmp/shared_prefix.json
                                                            # a smoke test (the demo model)

  sharing  no model: B rollouts drawn by ReplayBuffer.sample from a full buffer of N (groups of G
           of one prompt each): the distinct prompts in a batch, counted over 10,000 draws and as
           expected (each group is missed with probability C(N - G, B) / C(N, B)), and the token
           columns the shared forward computes over the plain one's, U x P + B x (max_len - 1)
           over B x (P + max_len - 1), at SmolLM2's P = 47 and max_len = 48. Settings: train.py
           --model smollm2 (B = 16 of N = 32, G = 4), the decisive comparison (B = N = 16, G = 4),
           the demo (B = N = 256, G = 8), and G = 16 as the paper's (B = 16 of N = 64: four
           groups held, an illustration).
  update   replay_rl.update_step, train.py's step (collate, the loss's forward and backward, the
           clip, an AdamW step at lr 0 so that every step does the same work), on one batch, with
           four log-prob functions (logp_fn): plain (completion_logp), chunked (train.py's default
           for SmolLM2's vocabulary, --logp-chunk 256), shared (shared_prefix_logp) and
           shared_chunked (--shared-prefix with --logp-chunk 256: the shared prefix, then the
           head 256 tokens at a time); the model and its settings as
           train.py --model smollm2 loads them (LoRA r 16, float32, T = 0.7, up to 48 new
           tokens), the batches its rollouts from generate_rollouts:
             G4        4 prompts x G = 4 (B = 16, whole groups)
             G16       1 prompt x G = 16 (B = 16, one group)
             G4_drawn  B = 16 drawn by ReplayBuffer.sample from a buffer of N = 32 (8 prompts x 4),
                       as train.py --model smollm2 draws them
           CPU seconds of the process (the figure to read on a loaded machine) and wall seconds
           per step, medians over the rounds after a warm-up round; shared over plain and over
           chunked, per round and as the ratio of the medians; the token columns of each forward;
           the largest |log pi| difference of shared and chunked from plain on the batch.

Load: os.getloadavg() before and after and the process's CPU over wall seconds are kept with the
figures; on a loaded machine read the ratios of a round, not the times.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import random
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

OUTPUT = os.path.join(ROOT, "docs", "results", "shared_prefix_cpu.json")
LOAD_NOTE = "cores not quiet (something else ran beside it)"    # --quiet-cores: nothing else ran
# (B, N, G) of each buffer setting of the sharing part
BUFFERS = {"smollm2": (16, 32, 4), "decisive": (16, 16, 4), "demo": (256, 256, 8),
           "paper_G16": (16, 64, 16)}
SMOLLM2_COLUMNS = (47, 48)                  # P, max_len: its sums prompts and longest completions
# the update's batches: prompts x G generated, and B drawn from them (None: all of them)
BATCHES = {"G4": dict(prompts=4, generations=4, drawn=None),
           "G16": dict(prompts=1, generations=16, drawn=None),
           "G4_drawn": dict(prompts=8, generations=4, drawn=16)}


# ---- how often a drawn batch shares its prompts ------------------------------------------------
def columns_ratio(distinct: float, B: int, P: int, max_len: int) -> float:
    """Token columns through the model, shared over plain: (U P + B (max_len - 1)) / (B (P +
    max_len - 1))."""
    return (distinct * P + B * (max_len - 1)) / (B * (P + max_len - 1))


def sharing(draws: int = 10_000) -> dict:
    from buffer import ReplayBuffer, Rollout
    P, max_len = SMOLLM2_COLUMNS
    out = {}
    for name, (B, N, G) in BUFFERS.items():
        buffer = ReplayBuffer(N, seed=0)
        buffer.add([Rollout(prompt_ids=torch.tensor([group]), completion_ids=torch.tensor([1]),
                            behaviour_logp=torch.zeros(1), reward=0.0, advantage=0.0,
                            policy_version=0, baseline=0.0, temperature=1.0)
                    for group in range(N // G) for _ in range(G)])
        counts = [len({int(r.prompt_ids[0]) for r in buffer.sample(B)}) for _ in range(draws)]
        expected = N // G * (1 - math.comb(N - G, B) / math.comb(N, B))
        mean = statistics.fmean(counts)
        out[name] = {"B": B, "N": N, "G": G, "draws": draws,
                     "distinct_prompts_mean": round(mean, 3),
                     "distinct_prompts_expected": round(expected, 3),
                     "distinct_prompts_range": [min(counts), max(counts)],
                     "rows_sharing_a_prompt_mean": round(B - mean, 3),
                     "columns_ratio_at_smollm2_lengths": round(columns_ratio(mean, B, P, max_len),
                                                               3)}
        print(f"  sharing {name}: B {B} of N {N}, G {G}: {mean:.2f} distinct prompts (expected "
              f"{expected:.2f}), columns x{out[name]['columns_ratio_at_smollm2_lengths']}",
              flush=True)
    return {"setting": f"ReplayBuffer.sample(B) from a full buffer of N // G groups of G rollouts "
                       f"of one prompt each, {draws} draws; columns at P = {P}, max_len = "
                       f"{max_len}", **out}


# ---- the update alone ----------------------------------------------------------------------------
def load(model_name: str):
    """(model, tokenizer, task, cfg) as train.py loads them (chat template, LoRA, float32)."""
    from infra import loading
    from infra import report
    import train
    report.quiet_libraries()
    argv = [] if model_name == "tiny" else ["--model", model_name]
    cfg = train.parse_config(argv + ["--no-progress", "--device", "cpu"])
    task = loading.load_task(cfg, training=False)
    model, tokenizer, task = loading.load_model(cfg, task, "cpu", 0)
    return model, tokenizer, task, cfg


def batch_of(name: str, model, tokenizer, task, cfg, seed: int = 0) -> list:
    """The rollouts of BATCHES[name]: generated at the run's settings, all of them or B drawn."""
    import rollout
    from buffer import ReplayBuffer
    from infra import generation
    setting = BATCHES[name]
    model.eval()
    torch.manual_seed(seed)
    prompts = random.Random(seed).sample(task.train_prompts, setting["prompts"])
    with warnings.catch_warnings():             # "equal rewards in every group": A is set below
        warnings.simplefilter("ignore", UserWarning)
        rollouts, _ = rollout.generate_rollouts(
            model, tokenizer, prompts, task.reward, num_generations=setting["generations"],
            max_new_tokens=cfg.max_new_tokens or task.max_new_tokens,
            temperature=cfg.temperature, policy_version=0,
            sampler=generation.recording_sampler(shared_prefill=False))
    # advantages of both signs: a gradient whatever the rewards were
    rollouts = [dataclasses.replace(r, advantage=(i % 3) - 1.0) for i, r in enumerate(rollouts)]
    if setting["drawn"]:
        buffer = ReplayBuffer(len(rollouts), seed=seed)
        buffer.add(rollouts)
        rollouts = buffer.sample(setting["drawn"])
    return rollouts


def arms() -> dict:
    from infra.engineered_update import LOGP_CHUNK, logp_fn
    from infra.shared_prefix import shared_prefix_logp
    return {"plain": None, "chunked": logp_fn(LOGP_CHUNK), "shared": shared_prefix_logp,
            "shared_chunked": functools.partial(shared_prefix_logp, chunk=LOGP_CHUNK)}


def columns_of(rollouts, pad_id: int, eos_ids: list[int]) -> dict:
    """B, P, max_len, the distinct prompts U, and the token columns each forward computes."""
    from buffer import collate
    cols = collate(rollouts, pad_id, eos_ids=eos_ids)
    B, max_len = cols["completion_mask"].shape
    P = cols["input_ids"].shape[1] - max_len
    U = len({tuple(row) for row in cols["input_ids"][:, :P].tolist()})
    return {"B": B, "P": P, "max_len": max_len, "distinct_prompts": U,
            "completion_tokens": int(cols["completion_mask"].sum()),
            "plain_columns": B * (P + max_len - 1), "shared_columns": U * P + B * (max_len - 1),
            "columns_ratio": round(columns_ratio(U, B, P, max_len), 3)}


def logp_differences(model, rollouts, pad_id: int, eos_ids: list[int], temperature: float) -> dict:
    """The largest |log pi_theta| difference of each arm from plain over the real tokens."""
    from buffer import collate
    from replay_rl import completion_logp
    cols = collate(rollouts, pad_id, eos_ids=eos_ids)
    real = cols["completion_mask"].bool()
    with torch.no_grad():
        found = {name: (fn or completion_logp)(model, cols, temperature)[0]
                 for name, fn in arms().items()}
    return {f"{name}_logp_max_diff": (found[name] - found["plain"])[real].abs().max().item()
            for name in found if name != "plain"}


def bench_update(name: str, loaded, rounds: int) -> dict:
    from replay_rl import update_step
    from rollout import end_token_ids
    model, tokenizer, task, cfg = loaded
    rollouts = batch_of(name, model, tokenizer, task, cfg)
    (eos_ids, pad_id), functions = end_token_ids(model, tokenizer), arms()
    model.eval()                                 # train.py steps in eval mode (dropout is off)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    times = {arm: [] for arm in functions}
    order = list(functions)
    for i in range(rounds + 1):
        for arm in order[i % len(order):] + order[:i % len(order)]:      # rotated each round
            wall, cpu = time.perf_counter(), time.process_time()
            update_step(model, optimizer, rollouts, pad_id=pad_id, eos_ids=eos_ids,
                        current_version=0, temperature=cfg.temperature, logp_fn=functions[arm])
            times[arm].append((time.process_time() - cpu, time.perf_counter() - wall))
        print(f"  {name} round {i}{' (warm-up)' if i == 0 else ''}: "
              + ", ".join(f"{arm} {t[-1][0]:.2f} cpu s" for arm, t in times.items()), flush=True)
    kept = {arm: t[1:] if rounds else t for arm, t in times.items()}    # the warm-up left out
    median = lambda arm, j: statistics.median(t[j] for t in kept[arm])
    out = {**columns_of(rollouts, pad_id, eos_ids),
           **logp_differences(model, rollouts, pad_id, eos_ids, cfg.temperature)}
    for arm in functions:
        out[f"{arm}_median_cpu_s"] = round(median(arm, 0), 3)
        out[f"{arm}_median_wall_s"] = round(median(arm, 1), 3)
        out[f"{arm}_cpu_s"] = [round(t[0], 3) for t in kept[arm]]
    for arm in ("shared", "shared_chunked"):
        for other in ("plain", "chunked"):
            for j, kind in ((0, "cpu"), (1, "wall")):
                out[f"{arm}_over_{other}_{kind}"] = round(median(arm, j) / median(other, j), 3)
            out[f"{arm}_over_{other}_cpu_each_round"] = [
                round(s[0] / o[0], 3) for s, o in zip(kept[arm], kept[other])]
    print(f"  {name}: shared / plain {out['shared_over_plain_cpu']}, shared_chunked / plain "
          f"{out['shared_chunked_over_plain_cpu']} (cpu), columns {out['columns_ratio']}",
          flush=True)
    return out


def load_evidence(wall0: float, cpu0: float, before: tuple) -> dict:
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"load_note": LOAD_NOTE, "cores": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "process_cpu_s": round(cpu, 1), "process_wall_s": round(wall, 1),
            "process_cpu_over_wall": round(cpu / wall, 3)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["sharing", "update"],
                   choices=["sharing", "update"])
    p.add_argument("--batches", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    p.add_argument("--model", default="smollm2", help="smollm2, or tiny (the demo: a smoke test)")
    p.add_argument("--rounds", type=int, default=4, help="update: rounds after a warm-up round")
    p.add_argument("--output", default=OUTPUT)
    p.add_argument("--quiet-cores", action="store_true",
                   help="say in the record that nothing else ran on the cores (the one who ran it "
                        "knows; the load averages kept beside the figures show it too)")
    args = p.parse_args(argv)
    global LOAD_NOTE
    if args.quiet_cores:
        LOAD_NOTE = "cores quiet (nothing else ran)"
    torch.set_num_threads(1)
    import transformers
    results = json.load(open(args.output)) if os.path.exists(args.output) else {}
    results.update({"torch": torch.__version__, "transformers": transformers.__version__,
                    "threads": torch.get_num_threads(), "load_note": LOAD_NOTE})
    if "sharing" in args.parts:
        results["sharing"] = sharing()
        write(args.output, results)
    if "update" in args.parts:
        loaded = load(args.model)
        results.setdefault("update", {})["model"] = loaded[3].model
        for name in args.batches:
            wall0, cpu0, before = time.perf_counter(), time.process_time(), os.getloadavg()
            results["update"][name] = {
                "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                **bench_update(name, loaded, args.rounds), **load_evidence(wall0, cpu0, before)}
            write(args.output, results)
    print(f"written to {args.output}")
    return results


def write(path: str, results: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
