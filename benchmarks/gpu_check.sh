#!/usr/bin/env bash
# On a GPU: the fast generation path and bench.py's time split; the README's memory rows next to
# memory_estimate.py's figures.
#
#     bash benchmarks/gpu_check.sh    # on a machine with a CUDA GPU; meant to take < 8 min on an H200 (never run yet)
#
# 1. builds a model with Qwen2.5-0.5B's shapes and random weights (152k vocabulary, the character tokenizer: it
#    only has to produce ids) in a local folder, and a GSM8K-format .jsonl whose prompts are ~231 tokens;
# 2. runs benchmarks/bench.py (first: the fast path is what no GPU has measured yet) on the same model (bf16, 128
#    new tokens, 64 rollouts, 3 repeats), with the fast generation path (--fast-generation: static cache, compiled
#    decode step) against plain generate: its speed-up, the compile time of its first call, the same-token
#    fraction and the log-prob check;
# 3. runs the three measured memory rows through train.py (2 rounds: the second one makes the first update,
#    of B = 128 rollouts) and prints the largest gen_peak_mem_gb / train_peak_mem_gb / gen_reserved_gb /
#    train_reserved_gb / peak_mem_gb of each run's metrics.jsonl, with memory_estimate.py's estimate for the same
#    model folder and longest prompt; the 4-bit row is skipped (with a message) without bitsandbytes.
# Everything printed also goes to $OUT/gpu_check.txt when $OUT is set (with the runs' metrics.jsonl files).
#
# Environment (defaults in brackets): GPU_CHECK_DIR work folder [a new temporary folder]; GPU_CHECK_TIE 1 = tied
# embedding / lm_head as the hub's Qwen2.5-0.5B, 0 = Qwen2Config's default, as the measured rows presumably
# had [0]; GPU_CHECK_LAYERS, GPU_CHECK_HIDDEN, GPU_CHECK_INTER, GPU_CHECK_HEADS, GPU_CHECK_KV_HEADS,
# GPU_CHECK_VOCAB: the model's shapes [24, 896, 4864, 14, 2, 151936]; GPU_CHECK_ROWS: which memory rows,
# e.g. "1 3" [1 2 3]; GPU_CHECK_BENCH=0 skips bench.py; GPU_CHECK_BUILD_ONLY=1 stops after step 1 (a CPU check
# of the script); GPU_CHECK_DEADLINE: seconds for the whole script [480]; PYTHON [python].
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WORK=${GPU_CHECK_DIR:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
DEADLINE=$(( SECONDS + ${GPU_CHECK_DEADLINE:-480} ))
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK"

# step timeout: at most $1 seconds, and never past the deadline
budget() { local left=$(( DEADLINE - SECONDS )); (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"; }

main() {
    echo "== gpu_check $(date -u +%Y-%m-%dT%H:%MZ) in $WORK"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
    "$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers', transformers.__version__,
'| peft', peft.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
    if "$PY" -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)" 2>/dev/null; then HAVE_BNB=1; else
        HAVE_BNB=0; echo "bitsandbytes: not installed"; fi

    echo "== 1. model with Qwen2.5-0.5B's shapes, random weights -> $WORK/model; prompts -> $WORK/gsm8k_231.jsonl"
    timeout "$(budget 120)" "$PY" - "$WORK" <<'EOF' || { echo "building the model failed"; return 1; }
import json, os, random, statistics, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
sys.path.insert(0, os.getcwd())
from demo import char_tokenizer
import tasks

work = sys.argv[1]
env = lambda name, default: int(os.environ.get(name, default))
tokenizer = char_tokenizer()
config = Qwen2Config(hidden_size=env("GPU_CHECK_HIDDEN", 896), intermediate_size=env("GPU_CHECK_INTER", 4864),
                     num_hidden_layers=env("GPU_CHECK_LAYERS", 24), num_attention_heads=env("GPU_CHECK_HEADS", 14),
                     num_key_value_heads=env("GPU_CHECK_KV_HEADS", 2), vocab_size=env("GPU_CHECK_VOCAB", 151936),
                     max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=bool(env("GPU_CHECK_TIE", 0)), pad_token_id=tokenizer.pad_token_id,
                     eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
torch.manual_seed(0)
model = Qwen2ForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(os.path.join(work, "model"))
tokenizer.save_pretrained(os.path.join(work, "model"))
n = sum(p.numel() for p in model.parameters())
print(f"model: {n / 1e6:.1f}M parameters, vocab {config.vocab_size}, tie_word_embeddings {config.tie_word_embeddings}")

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
EOF
    [[ ${GPU_CHECK_BUILD_ONLY:-0} == 1 ]] && { echo "GPU_CHECK_BUILD_ONLY=1: stopping after step 1"; return 0; }
    local pmax; pmax=$(cat "$WORK/prompt_max_tokens")

    if [[ ${GPU_CHECK_BENCH:-1} == 1 ]]; then
        # bench.py's update takes the whole batch at once (micro-batch 0): 64 rollouts keep it near 50 GB
        echo "== 2. bench.py --model <that model> --dtype bfloat16 --max-new-tokens 128 (64 rollouts, 3 repeats, fast path)"
        local t0=$SECONDS
        timeout "$(budget 200)" "$PY" benchmarks/bench.py --model "$WORK/model" --dtype bfloat16 --max-new-tokens 128 \
            --prompts 8 --num-generations 8 --batch-size 64 --buffer-size 64 --repeats 3 --warmup 1 \
            --fast-generation 2>&1 | tail -n 25
        echo "bench.py exit ${PIPESTATUS[0]} after $(( SECONDS - t0 )) s"
    fi
    echo "== 3. memory rows: train.py --max-rounds 2, 8 prompts x 8 generations, B = N = 128, bf16 compute"
    local extra=""
    "$PY" train.py --help 2>/dev/null | grep -q -- "--no-plot" && extra="--no-plot"
    local rows=${GPU_CHECK_ROWS:-1 2 3}
    for row in $rows; do
        local new micro flags name
        case $row in
            1) new=256; micro=8; flags="";                                        name="bf16 256 new, micro 8, no ckpt (measured 16.1)";;
            2) new=256; micro=2; flags="--gradient-checkpointing --load-in-4bit"; name="4-bit 256 new, micro 2, ckpt (measured 3.1)";;
            3) new=512; micro=2; flags="--gradient-checkpointing";                name="bf16 512 new, micro 2, ckpt (measured 4.0)";;
            *) echo "unknown row $row"; continue;;
        esac
        echo "-- row $row: $name"
        if [[ $flags == *4bit* && $HAVE_BNB == 0 ]]; then echo "skipped: bitsandbytes is not installed"; continue; fi
        local run="$WORK/run$row" t0=$SECONDS
        rm -rf "$run"
        # shellcheck disable=SC2086  # flags are words
        timeout "$(budget 130)" "$PY" train.py --model "$WORK/model" --task "$WORK/gsm8k_231.jsonl" --max-rounds 2 \
            --prompts-per-round 8 --num-generations 8 --batch-size 128 --buffer-size 128 --max-new-tokens "$new" \
            --micro-batch-size "$micro" $flags --dtype bfloat16 --eval-prompts 8 --no-chat-template \
            --output-dir "$run" $extra >"$WORK/run$row.log" 2>&1
        local rc=$?
        echo "train.py exit $rc after $(( SECONDS - t0 )) s$([[ $rc == 124 ]] && echo ' (timed out)')"
        (( rc != 0 )) && tail -n 5 "$WORK/run$row.log"
        "$PY" - "$run/metrics.jsonl" <<'EOF'
import json, sys
keys = ("gen_peak_mem_gb", "train_peak_mem_gb", "gen_reserved_gb", "train_reserved_gb", "peak_mem_gb")
best = {}
try:
    for line in open(sys.argv[1]):
        row = json.loads(line)
        for k in keys:
            if isinstance(row.get(k), (int, float)):
                best[k] = max(best.get(k, 0.0), row[k])
except (OSError, ValueError) as e:
    print(f"no metrics: {e}")
print("MEASURED " + ", ".join(f"{k} {best[k]:.2f}" if k in best else f"{k} n/a" for k in keys))
EOF
        # shellcheck disable=SC2086
        "$PY" benchmarks/memory_estimate.py --model "$WORK/model" --prompt-tokens "$pmax" --rollouts 64 \
            --max-new-tokens "$new" --micro-batch-size "$micro" $flags
        [[ -n ${OUT:-} && -f $run/metrics.jsonl ]] && cp "$run/metrics.jsonl" "$OUT/metrics_row$row.jsonl"
    done

    echo "== done in ${SECONDS} s"
}

if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT"
    main 2>&1 | tee "$OUT/gpu_check.txt"
else
    main 2>&1
fi
