"""The update's log-probs in chunks (engineered_update.chunked_completion_logp, train.py's default
--logp-chunk 256) against the plain ones (completion_logp, --logp-chunk 0), on this CPU: live
memory, step time, and train.py beside TRL's GRPOTrainer. Writes docs/results/chunked_logp_cpu.json.

    python benchmarks/chunked_logp.py                        # the three parts, ~45 min on 2 cores
    python benchmarks/chunked_logp.py --parts live steps     # some (the file keeps the others)

  live          bytes of the tensors alive at the peak of one update (forward, loss, backward;
                LiveBytes: every tensor created and still referenced, the weights left out),
                micro-batch 8 x 256 completion tokens (prompts of 32), on a random one-layer Qwen2
                with Qwen2.5's vocabulary (151,936) and hidden size 16 (so that the logits
                dominate), bf16, LoRA r = 16; plain and chunked.
  steps         update_step_engineered with --logp-chunk 0 and 256 alternated in one process
                (A B A B ...) on one batch of 16 SmolLM2-135M rollouts of up to 48 tokens (its sums
                task at T = 0.7, LoRA r = 16, AdamW at lr 0: every step the same work), one thread;
                CPU seconds of the process (the primary figure on a loaded machine), wall seconds,
                and the live-tensor peak of one step of each.
  side_by_side  train.py --model smollm2 with --logp-chunk 0 and with the default, and TRL's
                GRPOTrainer, each in a fresh process, one after another, one thread each: per step
                16 rollouts (4 prompts x 4) of up to 48 tokens, then one update on those 16 (LoRA
                r = 16 on all linear layers, lr 2.5e-4, no KL term, fp32); peak resident memory
                (ru_maxrss of the process, from wait4), CPU and wall seconds per step (medians, the
                first step left out); under glibc's default malloc and a fixed mmap threshold.
                TRL: pip install --no-deps trl (1.16.0 here; it needs nothing the project lacks).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

OUTPUT = os.path.join(ROOT, "docs", "results", "chunked_logp_cpu.json")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SMOLLM2_WORK = dict(prompts=4, generations=4, max_new_tokens=48, lora_r=16, lr=2.5e-4,
                    temperature=0.7)
# glibc's malloc raises its mmap threshold (up to 32 MB) as large blocks are freed; below it, freed
# memory stays in the process, so the peak RSS follows the order of allocations as much as the
# live bytes. A fixed threshold (setting it turns the raising off) returns every block above it at
# once: RSS then follows the live tensors. Both are measured: the default, as a user runs it.
ALLOCATORS = {"default_allocator": {}, "fixed_mmap_threshold": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the tensors created under this mode that are still alive, and their peak.
    exclude: data pointers of storages not to count (the weights)."""

    def __init__(self, exclude=()):
        super().__init__()
        self.exclude, self.live, self.now, self.peak = set(exclude), {}, 0, 0

    def _free(self, key):
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = (id(s), s.data_ptr())
                if s.data_ptr() in self.exclude or key in self.live or not s.nbytes():
                    continue
                self.live[key] = s.nbytes()
                self.now += s.nbytes()
                weakref.finalize(s, self._free, key)
                self.peak = max(self.peak, self.now)
        return out


def random_qwen2(folder: str, vocab: int, hidden: int, layers: int = 1,
                 dtype=torch.bfloat16) -> str:
    """A Qwen2 of random weights (tied embedding, as Qwen2.5-0.5B's), the character tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from infra.demo_model import char_tokenizer
    tokenizer = char_tokenizer()
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def random_batch(m: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> dict:
    """collate() of m rollouts of random tokens: prompts of ``prompt``, completions of
    ``completion`` tokens."""
    from buffer import Rollout, collate
    g = torch.Generator().manual_seed(seed)
    rollouts = [Rollout(prompt_ids=torch.randint(2, vocab, (prompt,), generator=g),
                        completion_ids=torch.randint(2, vocab, (completion,), generator=g),
                        behaviour_logp=-torch.rand(completion, generator=g), reward=float(i % 2),
                        advantage=float(i % 2) - 0.5, policy_version=0, baseline=0.5, temperature=1.0)
                for i in range(m)]
    return collate(rollouts, 0, 0, eos_ids=[1])      # the character tokenizer's EOS: none drawn


def update_live_peak(model, batch, chunk: int) -> int:
    """Peak live-tensor bytes of one forward + loss + backward: chunk > 0 chunked, 0 plain."""
    from replay_rl import batch_loss
    from infra.engineered_update import chunked_completion_logp
    log_probs = None
    if chunk:
        log_probs = lambda m, c, t: chunked_completion_logp(m, c, t, chunk)
    model.zero_grad(set_to_none=True)
    tracker = LiveBytes(p.untyped_storage().data_ptr() for p in model.parameters())
    with tracker:
        loss, _, _ = batch_loss(model, batch, logp_fn=log_probs)
        loss.backward()
    return tracker.peak


def live(micro: int = 8, completion: int = 256, vocab: int = 151_936, hidden: int = 16,
         chunk: int = 256) -> dict:
    from infra.policy import load_policy
    with tempfile.TemporaryDirectory() as folder:
        model, _ = load_policy(random_qwen2(folder, vocab, hidden), lora_r=16, dtype=torch.bfloat16)
    model.train()
    batch = random_batch(micro, 32, completion, vocab)
    peaks = {name: update_live_peak(model, batch, c)
             for name, c in (("chunked", chunk), ("plain", 0))}
    one_copy = micro * completion * vocab * 4
    return {"setting": f"one update (forward, loss, backward), micro-batch {micro} x {completion} "
                       f"completion tokens (prompts of 32), random one-layer Qwen2, vocabulary "
                       f"{vocab}, hidden {hidden}, bf16, LoRA r=16",
            "chunk": chunk, "plain_bytes": peaks["plain"], "chunked_bytes": peaks["chunked"],
            "chunked_over_plain": peaks["chunked"] / peaks["plain"],
            "plain_in_fp32_logit_copies": peaks["plain"] / one_copy,
            "chunked_in_fp32_chunk_logits": peaks["chunked"] / (chunk * vocab * 4)}


def smollm2_rollouts(seed: int = 0):
    """SmolLM2-135M as train.py --model smollm2 loads it (fp32, LoRA r = 16), and 16 rollouts of
    its sums task (4 prompts x 4, T = 0.7, up to 48 new tokens)."""
    from infra import loading
    from infra import report
    import rollout
    from infra import generation
    import train
    report.quiet_libraries()
    w = SMOLLM2_WORK
    cfg = train.parse_config(["--model", "smollm2", "--max-new-tokens", str(w["max_new_tokens"]),
                              "--no-progress", "--lora-r", str(w["lora_r"]), "--seed", str(seed)])
    task = loading.load_task(cfg, training=False)
    model, tokenizer, task = loading.load_model(cfg, task, "cpu", 0)
    model.eval()
    prompts = random.Random(seed).sample(task.train_prompts, w["prompts"])
    rollouts, _ = rollout.generate_rollouts(
        model, tokenizer, prompts, task.reward, num_generations=w["generations"],
        max_new_tokens=w["max_new_tokens"], temperature=cfg.temperature, policy_version=0,
        sampler=generation.recording_sampler(shared_prefill=False))
    model.train()
    return model, tokenizer, rollouts, cfg


def steps(pairs: int = 8) -> dict:
    """update_step_engineered, plain and chunked alternated; the first pair, a warm-up, left out."""
    from infra.engineered_update import LOGP_CHUNK, logp_fn, update_step_engineered
    from rollout import end_token_ids
    torch.set_num_threads(1)
    model, tokenizer, rollouts, cfg = smollm2_rollouts()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    variants = (("plain", 0), ("chunked", LOGP_CHUNK))
    step = lambda chunk: update_step_engineered(
        model, optimizer, rollouts, pad_id=tokenizer.pad_token_id,
        eos_ids=end_token_ids(model, tokenizer)[0], current_version=0,
        temperature=cfg.temperature, logp_fn=logp_fn(chunk))      # None for 0: plain
    times = {"plain": [], "chunked": []}
    for i in range(pairs + 1):
        for name, chunk in variants:
            cpu, wall = time.process_time(), time.perf_counter()
            step(chunk)
            if i:
                times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
        print(f"  pair {i}: " + ", ".join(f"{k} {v[-1][0]:.2f} cpu s" for k, v in times.items()
                                          if v and i), flush=True)
    live_mb = {}
    for name, chunk in variants:                        # one more step each, counted
        tracker = LiveBytes(p.untyped_storage().data_ptr() for p in model.parameters())
        with tracker:
            step(chunk)
        live_mb[f"{name}_live_peak_mb"] = round(tracker.peak / 2**20, 1)
    median = lambda name, j: statistics.median(t[j] for t in times[name])
    lengths = [len(r.completion_ids) for r in rollouts]
    prompts = [len(r.prompt_ids) for r in rollouts]
    kinds = ((0, "cpu"), (1, "wall"))
    return {"setting": f"update_step_engineered on 16 SmolLM2-135M rollouts (completions of "
                       f"{min(lengths)}-{max(lengths)} tokens, mean "
                       f"{statistics.fmean(lengths):.1f}; "
                       f"prompts of {min(prompts)}-{max(prompts)}), LoRA r=16, fp32, one thread, "
                       f"AdamW at lr 0; plain (--logp-chunk 0) and chunked (--logp-chunk "
                       f"{LOGP_CHUNK}) alternated, {pairs} pairs after a warm-up pair",
            **{f"{name}_{kind}_s": [round(t[j], 3) for t in times[name]]
               for name in times for j, kind in kinds},
            **{f"{name}_median_{kind}_s": round(median(name, j), 3)
               for name in times for j, kind in kinds},
            **live_mb,
            "chunked_over_plain_cpu": round(median("chunked", 0) / median("plain", 0), 3),
            "chunked_over_plain_wall": round(median("chunked", 1) / median("plain", 1), 3)}


def run_child(argv: list[str], env: dict) -> tuple[int, dict]:
    """Run a command in a fresh process: its exit code and resource usage (ru_maxrss, CPU s)."""
    process = subprocess.Popen(argv, env={**os.environ, **env, **ONE_THREAD}, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        print(stderr.decode()[-3000:], file=sys.stderr)
    return process.returncode, {"peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
                                "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}


def per_step(cpu: list[float], wall: list[float]) -> dict:
    """Medians (and all values) of per-step seconds, the first step left out."""
    return {"cpu_s_per_step": round(statistics.median(cpu[1:]), 3),
            "wall_s_per_step": round(statistics.median(wall[1:]), 3),
            "cpu_s": [round(x, 3) for x in cpu], "wall_s": [round(x, 3) for x in wall]}


def train_py(chunk: int, rounds: int, folder: str, env: dict) -> dict:
    """train.py --model smollm2 for ``rounds`` rounds of 16 rollouts and one update on them each."""
    w = SMOLLM2_WORK
    out = os.path.join(folder, f"train_chunk{chunk}_{len(env)}")
    argv = [sys.executable, "train.py", "--model", "smollm2", "--task", "sums",
            "--prompts-per-round", str(w["prompts"]), "--num-generations", str(w["generations"]),
            "--buffer-size", "16", "--batch-size", "16", "--no-skip-zero-advantage",
            "--max-new-tokens", str(w["max_new_tokens"]), "--lora-r", str(w["lora_r"]),
            "--lr", str(w["lr"]), "--temperature", str(w["temperature"]),
            "--max-rounds", str(rounds), "--eval-prompts", "1", "--eval-every", "1000",
            "--no-plot", "--no-progress", "--seed", "0", "--device", "cpu",
            "--logp-chunk", str(chunk), "--output-dir", out]
    code, usage = run_child(argv, env)
    rows = [] if code else [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = [r for r in rows if "loss" in r]             # one row per update, with the counters
    before = [None] + rows[:-1]
    def deltas(phases, kind):           # per step, from the counters the rows carry (cumulative)
        spent = lambda r: sum(r[f"{p}_{kind}"] for p in phases) if r else 0.0
        return [spent(b) - spent(a) for a, b in zip(before, rows)]
    result = {"command": " ".join(argv[1:]), "exit": code, "steps": len(rows), **usage}
    if rows:
        both = ("gen", "train")
        result.update(per_step(deltas(both, "cpu_seconds"), deltas(both, "seconds")))
        result["update_only"] = per_step(deltas(("train",), "cpu_seconds"),
                                         deltas(("train",), "seconds"))
    return result


def trl_child(steps_: int, output: str) -> None:
    """In a fresh process: TRL's GRPOTrainer on train_py's work; per-step seconds into output."""
    torch.set_num_threads(1)
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback

    from infra import loading
    from infra import pretrained
    from infra import report
    import tasks
    import train
    from infra.policy import load_tokenizer
    report.quiet_libraries()
    w = SMOLLM2_WORK
    path = pretrained.resolve(pretrained.SMOLLM2, log=lambda line: None)
    tokenizer = load_tokenizer(path)
    task = loading.load_task(train.parse_config(["--model", "smollm2", "--task", "sums"]))
    task = tasks.format_prompts(task, lambda p: tokenizer.apply_chat_template(
        [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True))
    dataset = Dataset.from_list([{"prompt": p} for p in task.train_prompts])

    def reward(prompts, completions, **kwargs):
        return [task.reward(p, c) for p, c in zip(prompts, completions)]

    times = {"cpu": [], "wall": []}

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.cpu, self.wall = time.process_time(), time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times["cpu"].append(time.process_time() - self.cpu)
            times["wall"].append(time.perf_counter() - self.wall)

    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=w["prompts"] * w["generations"],
        num_generations=w["generations"], max_completion_length=w["max_new_tokens"],
        temperature=w["temperature"], learning_rate=w["lr"], beta=0.0, max_steps=steps_,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False)               # TRL's default is on; train.py's off
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = LoraConfig(r=w["lora_r"], lora_alpha=2 * w["lora_r"], lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, peft_config=lora, callbacks=[StepTimes()])
    trainer.train()
    with open(output, "w") as f:
        json.dump({**times, "trl": trl.__version__, "loss_type": config.loss_type}, f)


def trl_grpo(steps_: int, folder: str, env: dict) -> dict:
    output = os.path.join(folder, f"trl_{len(env)}.json")
    argv = [sys.executable, os.path.abspath(__file__), "--trl-child", output,
            "--rounds", str(steps_)]
    code, usage = run_child(argv, env)
    result = {"command": "trl.GRPOTrainer (benchmarks/chunked_logp.py, trl_child): "
                         "per_device_train_batch_size 16, num_generations 4, max_completion_length "
                         "48, temperature 0.7, lr 2.5e-4, beta 0, LoRA r 16 / alpha 32 on "
                         "all-linear, fp32, use_cpu, gradient_checkpointing off (as train.py's)",
              "exit": code, **usage}
    if not code:
        found = json.load(open(output))
        result.update(per_step(found["cpu"], found["wall"]), trl_version=found["trl"],
                      loss_type=found["loss_type"], steps=len(found["cpu"]))
    return result


def own_peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def side_by_side(rounds: int = 6) -> dict:
    """Run first in its process (main does): a child's ru_maxrss starts from its parent's peak at
    the fork (Linux copies the high-water mark into the child), so a launcher that measured the
    plain logits of ``live`` (6 GB) would show in every child's figure."""
    started, found, launcher = time.time(), {}, own_peak_rss_mb()
    with tempfile.TemporaryDirectory() as folder:
        for allocator, env in ALLOCATORS.items():
            found[allocator] = {"env": env, "train_py_plain": train_py(0, rounds, folder, env),
                                "train_py_chunked": train_py(256, rounds, folder, env),
                                "trl_grpo": trl_grpo(rounds, folder, env)}
            figures = {k: {x: v[x] for x in ("peak_rss_mb", "cpu_s_per_step", "wall_s_per_step")
                           if x in v} for k, v in found[allocator].items() if k != "env"}
            print(allocator, json.dumps(figures), flush=True)
    return {"setting": f"one after another, each in a fresh process with one thread; {rounds} "
                       f"steps each (16 rollouts of up to 48 tokens, 4 prompts x 4, then one "
                       f"update on them; train.py's first and final evals of 1 prompt are "
                       f"outside the per-step figures), SmolLM2-135M (pretrained.py's conversion "
                       f"of the GGUF: fp32 weights), the sums task; under glibc's default malloc "
                       f"and with MALLOC_MMAP_THRESHOLD_=131072 (ALLOCATORS)",
            "launcher_peak_rss_mb": launcher,       # below every child's figure, or they are its
            "took_s": round(time.time() - started), **found}


def load_of_machine() -> dict:
    return {"cores": os.cpu_count(), "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "note": "the machine was loaded: two training processes of a long experiment (one "
                    "thread each) shared its 2 cores throughout; CPU seconds of the measured "
                    "process are the primary figure, wall seconds stretch with the load"}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["live", "steps", "side_by_side"],
                   choices=["live", "steps", "side_by_side"])
    p.add_argument("--pairs", type=int, default=8,
                   help="steps: plain/chunked pairs after a warm-up pair")
    p.add_argument("--rounds", type=int, default=6, help="side_by_side: steps of each variant")
    p.add_argument("--output", default=OUTPUT)
    p.add_argument("--trl-child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_child:
        return trl_child(args.rounds, args.trl_child)
    import transformers
    results = json.load(open(args.output)) if os.path.exists(args.output) else {}
    results.update({"torch": torch.__version__, "transformers": transformers.__version__})
    parts = {"side_by_side": lambda: side_by_side(args.rounds), "live": live,
             "steps": lambda: steps(args.pairs)}
    for part in sorted(set(args.parts), key=list(parts).index):     # side_by_side first
        results[part] = {"measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         **load_of_machine(), **parts[part]()}
        results[part]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
        print(f"{part}: written to {args.output}", flush=True)
    return results


if __name__ == "__main__":
    main()
