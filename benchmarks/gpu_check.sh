#!/usr/bin/env bash
# On a GPU: the fast generation path and bench.py's time split; the README's memory rows (and Qwen2.5-1.5B's
# 4-bit rows) next to memory_estimate.py's figures.
#
#     bash benchmarks/gpu_check.sh    # on a machine with a CUDA GPU; ends within GPU_CHECK_DEADLINE (500 s)
#
# 0. installs the wheels in .whl/ (bitsandbytes) into /tmp/site when bitsandbytes is missing (a machine with no
#    package registry: carry them; see the device notes), and puts /tmp/site on PYTHONPATH;
# 1. builds, on the GPU when there is one, a model with Qwen2.5-0.5B's shapes and random weights (152k
#    vocabulary, the character tokenizer: it only has to produce ids) and one with Qwen2.5-1.5B's shapes (tied
#    embedding, as the hub's), both saved in bf16; a GSM8K-format .jsonl whose prompts are ~231 tokens; and
#    the CUDA context's own memory (the GPU's used memory minus what torch reserved, after a bf16 matmul and
#    a 4-bit one): what "fits in" adds to the reserved peak;
# 2. runs benchmarks/bench.py on the 0.5B-shaped model (bf16, 128 new tokens, 64 rollouts, 3 repeats) with
#    --fast-generation: the fast path (static cache, compiled decode step) against plain generate (speed-up,
#    compile time of its first call, same-token fraction, log-prob check), update_overhead, and the round's
#    split with the fast path; with TORCH_LOGS=recompiles,graph_breaks,cudagraphs,perf_hints (its stderr).
#    If it prints no result (the fast path failed, say), bench.py runs again with the fast path replaced by
#    plain generate, for update_overhead and the split;
# 3. runs the memory rows through train.py (--max-rounds 2, 8 prompts x 8, B = N = 128: the second round makes
#    the first update), the greedy evals replaced by a stub (they measure nothing here and would double the
#    time; GPU_CHECK_EVAL=1 keeps them), and prints the largest gen_peak_mem_gb / train_peak_mem_gb /
#    gen_reserved_gb / train_reserved_gb / peak_mem_gb of each run with memory_estimate.py's estimate:
#      1-3: 0.5B: bf16 256 new micro 8; 4-bit 256 new micro 2 ckpt; bf16 512 new micro 2 ckpt (the README's);
#      4-5: 1.5B in 4-bit, gradient checkpointing, micro-batch 2, at 256 and 512 new tokens;
#      (rows 1-5 with --logp-chunk 0: the plain log-probs they were measured with on 2026-11-30)
#      6-9, not in the default list (GPU_CHECK_ROWS="6 7 8 9", with GPU_CHECK_BENCH=0 GPU_CHECK_DIAG=0: a few
#      minutes): 0.5B bf16, 256 new, gradient checkpointing, micro-batch 4 and 8, each with the plain log-probs
#      (--logp-chunk 0) and train.py's default chunks of 256: train_peak_mem_gb of plain against chunked.
#      Written 2026-12-02 and not run yet (no GPU was lent).
#    The rows run at the same time (per-process allocator figures do not depend on it; their wall times do);
#    the 4-bit rows are skipped (with a message) without bitsandbytes;
# 4. a diagnostic of the fast path, with what time is left: per-decode-step ms of plain and fast generate
#    (two lengths, differenced), dynamo's counters, the host syncs of one fast call, a profile of one call.
# Everything printed goes to $OUT/gpu_check.txt when $OUT is set, with at most 5 more files there:
# bench.txt (bench.py's output), bench_stderr.txt (its torch logs), metrics_rows.jsonl (every row's metrics
# lines, tagged "row"), train_logs.txt (the train.py logs), diag.txt.
#
# Environment (defaults in brackets): GPU_CHECK_DIR work folder [a new temporary folder]; GPU_CHECK_DEADLINE:
# seconds for the whole script [500]; GPU_CHECK_TIE 1 = tied embedding / lm_head as the hub's Qwen2.5-0.5B,
# 0 = Qwen2Config's default, as the measured rows presumably had [0]; GPU_CHECK_LAYERS, GPU_CHECK_HIDDEN,
# GPU_CHECK_INTER, GPU_CHECK_HEADS, GPU_CHECK_KV_HEADS, GPU_CHECK_VOCAB: the 0.5B model's shapes
# [24, 896, 4864, 14, 2, 151936]; GPU_CHECK_BIG_LAYERS, _HIDDEN, _INTER, _HEADS, _KV_HEADS, _VOCAB, _TIE: the
# 1.5B model's [28, 1536, 8960, 12, 2, 151936, 1]; GPU_CHECK_ROWS: which memory rows, e.g. "1 3", "" none [1 2 3 4 5];
# GPU_CHECK_PARALLEL=0 runs them one after another [1]; GPU_CHECK_TOKEN_DIV divides the rows' new tokens (a
# quick CPU pass) [1]; GPU_CHECK_BENCH=0 skips bench.py; GPU_CHECK_BENCH_TOKENS, _REPEATS, _WARMUP [128, 3, 1];
# GPU_CHECK_DIAG=0 skips the diagnostic; GPU_CHECK_EVAL=1 keeps train.py's greedy evals; GPU_CHECK_BUILD_ONLY=1
# stops after step 1 (a CPU check of the script); GPU_CHECK_WHEELS: the wheel folder [.whl]; PYTHON [python3].
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
WORK=${GPU_CHECK_DIR:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
DEADLINE=$(( SECONDS + ${GPU_CHECK_DEADLINE:-500} ))
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$WORK"
O=${OUT:-$WORK/out}          # the files that come back
mkdir -p "$O"
ROWS=${GPU_CHECK_ROWS-1 2 3 4 5}      # empty: no rows
DIV=${GPU_CHECK_TOKEN_DIV:-1}
TORCH_LOG_SET="recompiles,graph_breaks,cudagraphs,perf_hints"

# step timeout: at most $1 seconds, and never past the deadline
budget() { local left=$(( DEADLINE - SECONDS )); (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
left() { echo $(( DEADLINE - SECONDS )); }
# a log file of at most 8 MB: its first and last 4 MB
cap_file() { [[ -f $1 ]] || return 0; local n; n=$(stat -c %s "$1"); (( n <= 8000000 )) && return 0
    { head -c 4000000 "$1"; printf '\n[... %s bytes cut ...]\n' $(( n - 8000000 )); tail -c 4000000 "$1"; } >"$1.cut"
    mv "$1.cut" "$1"; }

# row -> R_MODEL R_NEW R_MICRO R_FLAGS R_NAME R_CAP (serial timeout)
row_spec() {
    case $1 in
        1) R_MODEL=model;   R_NEW=256; R_MICRO=8; R_FLAGS="";                                        R_CAP=150
           R_NAME="0.5B bf16, 256 new, micro 8, no ckpt (measured 16.1 allocated)";;
        2) R_MODEL=model;   R_NEW=256; R_MICRO=2; R_FLAGS="--gradient-checkpointing --load-in-4bit"; R_CAP=150
           R_NAME="0.5B 4-bit, 256 new, micro 2, ckpt (measured 3.1 allocated)";;
        3) R_MODEL=model;   R_NEW=512; R_MICRO=2; R_FLAGS="--gradient-checkpointing";                R_CAP=180
           R_NAME="0.5B bf16, 512 new, micro 2, ckpt (measured 4.0 allocated)";;
        4) R_MODEL=model15; R_NEW=256; R_MICRO=2; R_FLAGS="--gradient-checkpointing --load-in-4bit"; R_CAP=180
           R_NAME="1.5B 4-bit, 256 new, micro 2, ckpt (not measured before)";;
        5) R_MODEL=model15; R_NEW=512; R_MICRO=2; R_FLAGS="--gradient-checkpointing --load-in-4bit"; R_CAP=240
           R_NAME="1.5B 4-bit, 512 new, micro 2, ckpt (estimated 5.0 allocated)";;
        6|7|8|9)   # plain log-probs (6, 8) against train.py's chunks of 256 (7, 9), micro-batch 4 and 8
           R_MODEL=model; R_NEW=256; R_MICRO=$(( $1 < 8 ? 4 : 8 )); R_CAP=180
           R_FLAGS="--gradient-checkpointing"; R_NAME="log-probs in chunks of 256 (train.py's default)"
           (( $1 % 2 == 0 )) && R_FLAGS+=" --logp-chunk 0" && R_NAME="plain log-probs"
           R_NAME="0.5B bf16, 256 new, micro $R_MICRO, ckpt, $R_NAME (not measured before)";;
        *) return 1;;
    esac
    (( $1 <= 5 )) && R_FLAGS+="${R_FLAGS:+ }--logp-chunk 0"     # as measured on 2026-11-30: plain log-probs
    R_NEW=$(( R_NEW / DIV ))
}

install_wheels() {
    local dir=${GPU_CHECK_WHEELS:-.whl}
    if "$PY" -c "import bitsandbytes" 2>/dev/null; then return 0; fi
    if ! compgen -G "$dir/*.whl" >/dev/null; then echo "no wheels in $dir"; return 0; fi
    echo "== 0. installing $(cd "$dir" && echo *.whl) into /tmp/site"
    timeout "$(budget 90)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$dir"/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
        || echo "installing the wheels failed"
}

build_models() {   # $1: build the 1.5B-shaped model too (1/0)
    timeout "$(budget 180)" "$PY" - "$WORK" "$1" <<'EOF'
import json, os, random, statistics, subprocess, sys, time
import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM
sys.path.insert(0, os.getcwd())
from infra.demo_model import char_tokenizer
import tasks

work, big = sys.argv[1], sys.argv[2] == "1"
env = lambda name, default: int(os.environ.get(name, default))
dev = "cuda" if torch.cuda.is_available() else "cpu"
transformers.utils.logging.disable_progress_bar()


def smi_used_mib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(out.split()[0])
    except Exception:
        return None


base_mib = smi_used_mib() if dev == "cuda" else None     # before this process touches the GPU
tokenizer = char_tokenizer()


def build(name, prefix, defaults):
    t0 = time.time()
    h, inter, layers, heads, kv, vocab, tie = (env(f"{prefix}_{k}", d) for k, d in zip(
        ("HIDDEN", "INTER", "LAYERS", "HEADS", "KV_HEADS", "VOCAB", "TIE"), defaults))
    config = Qwen2Config(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=bool(tie),
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    # built in bf16 where it runs (the GPU: seconds, not minutes for 1.5B parameters on a CPU), then saved
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.to(device="cpu", dtype=torch.bfloat16)        # saved from host memory
    path = os.path.join(work, name)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n / 1e6:.1f}M parameters (h {h}, I {inter}, {layers} layers, {heads}/{kv} heads), vocab "
          f"{vocab}, tie_word_embeddings {config.tie_word_embeddings}; built on {dev} and saved in "
          f"{time.time() - t0:.1f} s")
    del model


build("model", "GPU_CHECK", (896, 4864, 24, 14, 2, 151936, 0))
if big:
    build("model15", "GPU_CHECK_BIG", (1536, 8960, 28, 12, 2, 151936, 1))

# GSM8K format: the prompt is gsm8k_prompt(question) (question + the instruction line), one token per character
# with this tokenizer; prompts of 225..237 tokens (mean ~231): a little padding, as with GSM8K.
rng = random.Random(0)
words = "tom has apples and buys more at the store each box holds some pens she gives half to her friend how many".split()
rows, lengths = [], []
overhead = len(tasks.gsm8k_prompt(""))               # the instruction line around the question
for i in range(200):
    target = 231 - overhead + rng.randint(-6, 6)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    q = f"{a} and {b}:"
    while len(q) < target:
        q += " " + rng.choice(words)
    q = q[:target - 1].rstrip() + "?"
    rows.append({"question": q, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    lengths.append(len(tokenizer(tasks.gsm8k_prompt(q), add_special_tokens=False).input_ids))
with open(os.path.join(work, "gsm8k_231.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
print(f"prompts: {len(rows)}, tokens mean {statistics.mean(lengths):.1f}, min {min(lengths)}, max {max(lengths)}")
with open(os.path.join(work, "prompt_max_tokens"), "w") as f:
    f.write(str(max(lengths)))

if dev == "cuda":   # the CUDA context's own memory: GPU used memory - torch's reserved, after a bf16 and a 4-bit matmul
    torch.cuda.empty_cache()
    x = torch.randn(1024, 1536, device=dev, dtype=torch.bfloat16)
    y = x @ torch.randn(1536, 1536, device=dev, dtype=torch.bfloat16)
    note = "bf16 matmul"
    try:
        import bitsandbytes as bnb
        lin = bnb.nn.Linear4bit(1536, 1536, compute_dtype=torch.bfloat16, quant_type="nf4").to(dev)
        y = lin(x)
        note += " + bitsandbytes 4-bit linear"
    except Exception as e:
        note += f" (no 4-bit: {type(e).__name__})"
    torch.cuda.synchronize()
    used = smi_used_mib()
    reserved = torch.cuda.memory_reserved() / 2**20
    if used is not None and base_mib is not None:
        print(f"CONTEXT: GPU used {used:.0f} MiB with this process ({note}), {base_mib:.0f} MiB before it, torch "
              f"reserved {reserved:.0f} MiB: context and libraries ~{(used - base_mib - reserved) / 1024:.2f} GB")
    else:
        print("CONTEXT: nvidia-smi did not answer")
EOF
}

# the diagnostic of the fast path (step 4); argv: model folder, new tokens, seconds it may take
write_diag() {
    cat >"$WORK/diag.py" <<'EOF'
import collections, json, os, random, statistics, sys, time, warnings
sys.path.insert(0, os.getcwd())
import torch
import transformers
import tasks
from replay_rl import load_policy
from infra.fast_decoding import FastDecoding
from rollout import generate_rollouts
from train import Config

start = time.time()
model_path, long_n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
short_n = max(long_n // 4, 2)
time_left = lambda: seconds - (time.time() - start)
cfg = Config()
dev = "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
print(f"DIAG torch {torch.__version__}, transformers {transformers.__version__}, device {dev}")
task = tasks.load_task(cfg.task)                   # as bench.py: the same prompts, so the same cache length
model, tokenizer = load_policy(model_path, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, device=dev,
                               dtype=torch.bfloat16)
model.eval()
prompts = random.Random(0).sample(task.train_prompts, 8)


def call(n, fast=None):
    torch.manual_seed(0)
    sync()
    t = time.perf_counter()
    _, stats = generate_rollouts(model, tokenizer, prompts, task.reward, num_generations=8, max_new_tokens=n,
                                 temperature=cfg.temperature, top_p=cfg.top_p, fast=fast)
    sync()
    return time.perf_counter() - t


def per_step(fast=None, reps=2):
    longs = [call(long_n, fast) for _ in range(reps)]
    shorts = [call(short_n, fast) for _ in range(reps)]
    lo, sh = statistics.median(longs), statistics.median(shorts)
    return lo, sh, 1000 * (lo - sh) / (long_n - short_n)


call(short_n)                                       # warm
lo, sh, plain_step = per_step()
print(f"DIAG plain generate: {long_n} new {lo:.2f} s, {short_n} new {sh:.2f} s -> {plain_step:.1f} ms per decode step")
fast = FastDecoding(model)
first = call(long_n, fast)
print(f"DIAG fast path: first call (compiles) {first:.1f} s")
base = model.get_base_model()
try:
    from transformers import GenerationConfig
    gc = GenerationConfig(do_sample=True, max_new_tokens=long_n)
    cache = next(iter(fast.caches.values()))             # the one the calls use (not reset here)
    kw = {"cache": cache, "past_key_values": cache}
    print(f"DIAG transformers' auto-compile criteria: {base._valid_auto_compile_criteria(kw, gc)}; "
          f"{type(cache).__name__} of length {fast.length} for batch sizes {sorted(fast.caches)}; "
          f"generation_config.compile_config {base.generation_config.compile_config}")
except Exception as e:
    print(f"DIAG auto-compile criteria: not checked ({type(e).__name__}: {e})")
lo, sh, fast_step = per_step(fast)
print(f"DIAG fast path: {long_n} new {lo:.2f} s, {short_n} new {sh:.2f} s -> {fast_step:.1f} ms per decode step; "
      f"per-step speed-up {plain_step / max(fast_step, 1e-3):.2f}x")
from torch._dynamo.utils import counters
counters = {k: dict(v) for k, v in counters.items() if v}
print("DIAG dynamo counters: " + json.dumps(counters, default=str)[:6000])

if dev == "cuda" and time_left() > 20:              # which calls wait for the GPU during one fast call
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call(short_n, fast)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    print(f"DIAG host syncs in one fast call of {short_n} new tokens: {sum(where.values())}; by place: "
          + "; ".join(f"{k} x{v}" for k, v in where.most_common(12)))

for label, f in (("fast", fast), ("plain", None)):
    if time_left() < 25:
        print(f"DIAG profile of a {label} call: skipped, {time_left():.0f} s left")
        continue
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    try:
        with profile(activities=acts) as prof:
            wall = call(short_n, f)
        ka = prof.key_averages()
        dev_us = sum(getattr(e, "self_device_time_total", 0) for e in ka       # the kernels' own events
                     if str(getattr(e, "device_type", "")).endswith("CUDA"))
        print(f"DIAG profile of a {label} call ({short_n} new tokens, {wall:.2f} s with the profiler): device busy "
              f"{dev_us / 1e3:.0f} ms = {dev_us / 1e6 / wall:.0%} of the wall time")
        for key in ("self_cpu_time_total", "self_device_time_total" if dev == "cuda" else None):
            if key:
                try:
                    print(ka.table(sort_by=key, row_limit=18, max_name_column_width=60))
                except Exception as e:
                    print(f"(table by {key}: {type(e).__name__}: {e})")
        print("DIAG calls per decode step: " + ", ".join(
            f"{e.key} {e.count / short_n:.1f}" for e in ka if e.key in (
                "cudaGraphLaunch", "cudaLaunchKernel", "cudaStreamSynchronize", "cudaMemcpyAsync",
                "cudaDeviceSynchronize", "cudaEventSynchronize", "cuLaunchKernel", "cuLaunchKernelEx",
                "aten::item", "aten::_local_scalar_dense")))
    except Exception as e:
        print(f"DIAG profile of a {label} call failed: {type(e).__name__}: {e}")
print(f"DIAG done in {time.time() - start:.0f} s")
EOF
}

# train.py with the greedy evals stubbed out (GPU_CHECK_EVAL=1 keeps them); argv as train.py's
write_driver() {
    cat >"$WORK/train_driver.py" <<'EOF'
import os, runpy, sys
sys.path.insert(0, os.getcwd())
from infra import generation
if os.environ.get("GPU_CHECK_EVAL", "0") != "1" and hasattr(generation, "greedy_rewards"):
    # greedy generation of every eval prompt to the max new tokens (random weights): half of the run's time
    generation.greedy_rewards = lambda model, tokenizer, prompts, reward_fns, **kw: dict.fromkeys(reward_fns, 0.0)
    print("gpu_check: greedy evals stubbed out (accuracy 0)", flush=True)
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
EOF
}

launch_row() {   # row, timeout seconds, threads: runs train.py for that row, writes run$row.{log,rc}
    local row=$1 t=$2 threads=$3
    row_spec "$row"
    local run="$WORK/run$row" t0=$SECONDS
    rm -rf "$run"
    # shellcheck disable=SC2086  # flags are words
    OMP_NUM_THREADS=$threads timeout -k 10 "$t" "$PY" "$WORK/train_driver.py" --model "$WORK/$R_MODEL" \
        --task "$WORK/gsm8k_231.jsonl" --max-rounds 2 --prompts-per-round 8 --num-generations 8 --batch-size 128 \
        --buffer-size 128 --max-new-tokens "$R_NEW" --micro-batch-size "$R_MICRO" $R_FLAGS --dtype bfloat16 \
        --eval-prompts 8 --no-chat-template --output-dir "$run" $NOPLOT >"$WORK/run$row.log" 2>&1
    echo "$? $(( SECONDS - t0 ))" >"$WORK/run$row.rc"
}

report_row() {   # row: its exit, measured peaks, estimate; appends its metrics to metrics_rows.jsonl
    local row=$1 rc secs pmax
    row_spec "$row"
    pmax=$(cat "$WORK/prompt_max_tokens")
    read -r rc secs <"$WORK/run$row.rc" 2>/dev/null || { rc="?"; secs="?"; }
    echo "-- row $row: $R_NAME: train.py exit $rc after $secs s$([[ $rc == 124 || $rc == 137 ]] && echo ' (timed out)')"
    [[ $rc != 0 ]] && tail -n 6 "$WORK/run$row.log" | cut -c1-400
    { echo "===== row $row: $R_NAME (exit $rc, $secs s)"; cat "$WORK/run$row.log"; } >>"$O/train_logs.txt"
    "$PY" - "$WORK/run$row/metrics.jsonl" "$row" "$O/metrics_rows.jsonl" "$WORK/$R_MODEL" "$pmax" "$R_NEW" \
        "$R_MICRO" "$R_FLAGS" "$R_NAME, exit $rc, $secs s" 2>&1 >>"$WORK/summary_rows.txt" <<'EOF'
import json, os, sys
keys = ("gen_peak_mem_gb", "train_peak_mem_gb", "gen_reserved_gb", "train_reserved_gb", "peak_mem_gb")
path, row_id, out, model, pmax, new, micro, flags, name = sys.argv[1:]
best, lines = {}, []
try:
    for line in open(path):
        row = json.loads(line)
        lines.append(json.dumps({"row": int(row_id), **row}))
        for k in keys:
            if isinstance(row.get(k), (int, float)):
                best[k] = max(best.get(k, 0.0), row[k])
except (OSError, ValueError) as e:
    print(f"no metrics: {e}", file=sys.stderr)
with open(out, "a") as f:
    f.writelines(l + "\n" for l in lines)
print("MEASURED " + ", ".join(f"{k} {best[k]:.2f}" if k in best else f"{k} n/a" for k in keys), file=sys.stderr)
try:                                              # one summary line: measured allocated / reserved, estimate
    sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
    import memory_estimate
    with open(os.path.join(model, "config.json")) as f:
        est = memory_estimate.estimate(json.load(f), load_in_4bit="4bit" in flags, rollouts=64,
                                       prompt_tokens=int(pmax), max_new_tokens=int(new), micro_batch=int(micro),
                                       gradient_checkpointing="checkpointing" in flags,
                                       logp_chunk=0 if "--logp-chunk 0" in flags else memory_estimate.LOGP_CHUNK)
        est_train = est["train_peak"]
        est = est["peak"]
except Exception as e:
    est = est_train = float("nan")
    print(f"estimate failed: {type(e).__name__}: {e}", file=sys.stderr)
g = lambda k: f"{best[k]:.2f}" if k in best else "n/a"
err = f"{(est - best['peak_mem_gb']) / best['peak_mem_gb']:+.0%}" if best.get("peak_mem_gb") else "n/a"
print(f"| {row_id} | {name} | {g('gen_peak_mem_gb')} / {g('train_peak_mem_gb')} | {g('gen_reserved_gb')} / "
      f"{g('train_reserved_gb')} | {g('peak_mem_gb')} | {est:.2f} (train {est_train:.2f}) | {err} |")
EOF
    # shellcheck disable=SC2086
    "$PY" benchmarks/memory_estimate.py --model "$WORK/$R_MODEL" --prompt-tokens "$pmax" --rollouts 64 \
        --max-new-tokens "$R_NEW" --micro-batch-size "$R_MICRO" $R_FLAGS | cut -c1-300
}

main() {
    echo "== gpu_check $(date -u +%Y-%m-%dT%H:%MZ) in $WORK; deadline in $(left) s"
    install_wheels
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,compute_mode --format=csv,noheader \
        2>/dev/null || echo "(no nvidia-smi)"
    "$PY" -c "import sys, torch, transformers, peft; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| transformers', transformers.__version__, '| peft', peft.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
    if "$PY" -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)" 2>/dev/null; then HAVE_BNB=1; else
        HAVE_BNB=0; echo "bitsandbytes: not installed"; fi

    local big=0 t0=$SECONDS
    [[ " $ROWS " == *" 4 "* || " $ROWS " == *" 5 "* ]] && big=1
    echo "== 1. models with Qwen2.5-0.5B's$( ((big)) && echo " and Qwen2.5-1.5B's") shapes, random weights -> $WORK;" \
         "prompts -> $WORK/gsm8k_231.jsonl"
    build_models "$big" || { echo "building the models failed after $(( SECONDS - t0 )) s"; return 1; }
    echo "built in $(( SECONDS - t0 )) s"
    [[ ${GPU_CHECK_BUILD_ONLY:-0} == 1 ]] && { echo "GPU_CHECK_BUILD_ONLY=1: stopping after step 1"; return 0; }
    write_diag
    write_driver
    NOPLOT=""
    "$PY" train.py --help 2>/dev/null | grep -q -- "--no-plot" && NOPLOT="--no-plot"

    if [[ ${GPU_CHECK_BENCH:-1} == 1 ]]; then
        # bench.py's update takes the whole batch at once (micro-batch 0): 64 rollouts keep it near 50 GB
        local bargs=(--model "$WORK/model" --dtype bfloat16 --max-new-tokens "${GPU_CHECK_BENCH_TOKENS:-128}"
                     --prompts 8 --num-generations 8 --batch-size 64 --buffer-size 64
                     --repeats "${GPU_CHECK_BENCH_REPEATS:-3}" --warmup "${GPU_CHECK_BENCH_WARMUP:-1}" --fast-generation)
        echo "== 2. bench.py ${bargs[*]}  (TORCH_LOGS=$TORCH_LOG_SET -> bench_stderr.txt)"
        t0=$SECONDS
        TORCH_LOGS=$TORCH_LOG_SET timeout -k 10 "$(budget 270)" "$PY" benchmarks/bench.py "${bargs[@]}" \
            >"$O/bench.txt" 2>"$O/bench_stderr.txt"
        local rc=$?
        tail -n 16 "$O/bench.txt"
        echo "bench.py exit $rc after $(( SECONDS - t0 )) s$([[ $rc == 124 || $rc == 137 ]] && echo ' (timed out)')"
        if ! grep -q '^{' "$O/bench.txt"; then
            echo "bench.py printed no result; the end of its stderr:"
            grep -v '^\s*$' "$O/bench_stderr.txt" | tail -n 12 | cut -c1-300
            if (( $(left) > 250 )); then
                echo "== 2b. bench.py again, the fast path replaced by plain generate (update_overhead, split)"
                t0=$SECONDS
                timeout -k 10 "$(budget 180)" "$PY" - "${bargs[@]}" >>"$O/bench.txt" 2>>"$O/bench_stderr.txt" <<'EOF'
import os, runpy, sys
sys.path.insert(0, os.getcwd())
from infra import fast_decoding


class PlainDecoding:          # what generate_rollouts asks of a FastDecoding, giving plain generate
    compile_config = None

    def __init__(self, *args, **kwargs):
        pass

    def generate_kwargs(self, batch_size, length):
        return {}


fast_decoding.FastDecoding = PlainDecoding
print("gpu_check: FastDecoding replaced by plain generate (the fast_* figures compare plain with plain)")
sys.argv = ["benchmarks/bench.py", *sys.argv[1:]]
runpy.run_path("benchmarks/bench.py", run_name="__main__")
EOF
                echo "bench.py (plain) exit $? after $(( SECONDS - t0 )) s"
                tail -n 16 "$O/bench.txt"
            fi
        fi
        cap_file "$O/bench_stderr.txt"
        echo "bench_stderr.txt: $(grep -c -i 'recompil' "$O/bench_stderr.txt") lines about recompiles," \
             "$(grep -c -i 'graph break' "$O/bench_stderr.txt") about graph breaks," \
             "$(grep -c -i 're-record\|Recording' "$O/bench_stderr.txt") about cudagraph recording," \
             "$(grep -c -i 'skipping cudagraphs' "$O/bench_stderr.txt") about skipped cudagraphs"
    fi

    echo "== 3. memory rows ($ROWS): train.py --max-rounds 2, 8 prompts x 8 generations, B = N = 128, bf16 compute"
    local todo=() row
    for row in $ROWS; do
        row_spec "$row" || { echo "unknown row $row"; continue; }
        if [[ $R_FLAGS == *4bit* && $HAVE_BNB == 0 ]]; then echo "-- row $row: $R_NAME: skipped, no bitsandbytes"; continue; fi
        todo+=("$row")
    done
    t0=$SECONDS
    local parallel=${GPU_CHECK_PARALLEL:-1} mode
    mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -n 1)
    if [[ $parallel == 1 && -n $mode && $mode != Default ]]; then
        echo "compute mode $mode: one process at a time, the rows run one after another"; parallel=0
    fi
    if [[ $parallel == 1 && ${#todo[@]} -gt 1 ]]; then
        local t; t=$(budget 330)
        echo "rows ${todo[*]} at the same time, each under ${t} s"
        for row in "${todo[@]}"; do launch_row "$row" "$t" 3 & done
        wait
        echo "rows done in $(( SECONDS - t0 )) s"
        for row in "${todo[@]}"; do report_row "$row"; done
    else
        for row in "${todo[@]}"; do
            row_spec "$row"
            launch_row "$row" "$(budget "$R_CAP")" "${OMP_NUM_THREADS:-4}"
            report_row "$row"
        done
    fi

    if [[ ${GPU_CHECK_DIAG:-1} == 1 ]]; then
        local l; l=$(left)
        if (( l >= 60 )); then
            echo "== 4. diagnostic of the fast path (TORCH_LOGS=$TORCH_LOG_SET; all in diag.txt), $l s left"
            t0=$SECONDS
            TORCH_LOGS=$TORCH_LOG_SET timeout -k 5 "$(budget 200)" "$PY" "$WORK/diag.py" "$WORK/model" \
                "${GPU_CHECK_BENCH_TOKENS:-128}" "$(( $(budget 200) - 15 ))" >"$O/diag.txt" 2>&1
            echo "diag exit $? after $(( SECONDS - t0 )) s"
            grep '^DIAG' "$O/diag.txt" | cut -c1-1500
            cap_file "$O/diag.txt"
        else
            echo "== 4. diagnostic skipped: $l s left"
        fi
    fi
    echo "== summary"
    [[ -f $O/bench.txt ]] && "$PY" - "$O/bench.txt" <<'EOF'
import json, sys
found = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
keys = ("fast_generation", "fast_first_call_s", "fast_same_tokens", "fast_logp_max_diff", "fast_rollout_ms",
        "plain_rollout_ms", "update_overhead", "rollout_overhead", "generation_fraction", "gen_tokens_per_s",
        "train_tokens_per_s", "update_ms", "bare_update_ms")
for r in found:
    print("bench: " + ", ".join(f"{k} {r[k]}" for k in keys if k in r))
if not found:
    print("bench: no result")
EOF
    grep '^CONTEXT' "$O/gpu_check.txt" | tail -n 1
    if [[ -f $WORK/summary_rows.txt ]]; then
        echo "| row | what | allocated GB gen / train | reserved GB gen / train | peak allocated | estimate | est. error |"
        echo "|---|---|---|---|---|---|---|"
        cat "$WORK/summary_rows.txt"
    fi
    echo "== done in ${SECONDS} s"
}

rm -f "$O"/{bench.txt,bench_stderr.txt,metrics_rows.jsonl,train_logs.txt,diag.txt} "$WORK/summary_rows.txt"
main 2>&1 | tee "$O/gpu_check.txt"
