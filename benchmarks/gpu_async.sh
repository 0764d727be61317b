#!/usr/bin/env bash
# On one GPU: synchronous rounds against one generation worker (train.py --generators 1) with the
# worker and the trainer sharing the device, in the regime where generation is most of a round.
#
#     bash benchmarks/gpu_async.sh          # on a machine with a CUDA GPU; within GPU_ASYNC_DEADLINE (480 s)
#
# 1. builds a model with Qwen2.5-0.5B's shapes and random weights, and GSM8K-format prompts of ~231
#    tokens (benchmarks/gpu_check.sh's step 1): random weights rarely emit an end token, so every
#    completion runs to --max-new-tokens;
# 2. runs benchmarks/async_throughput.py on it: bf16, 8 prompts x 8, 128 new tokens, B = 64, one
#    pair at S = B and one at S = 0, GPU_ASYNC_ROUNDS rounds a run [6].
# Its output goes to $OUT/gpu_async.txt when $OUT is set (the last line: one JSON object).
# Environment: GPU_ASYNC_DIR work folder [a new temporary folder]; GPU_CHECK_* shapes as gpu_check.sh
# (small ones make a CPU smoke test: GPU_ASYNC_DEVICE=cpu); PYTHON [python3].
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
WORK=${GPU_ASYNC_DIR:-$(mktemp -d /tmp/gpu_async.XXXXXX)}
O=${OUT:-$WORK/out}
mkdir -p "$O"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
DEADLINE=${GPU_ASYNC_DEADLINE:-480}
{
    echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
    "$PY" -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
    t0=$SECONDS
    GPU_CHECK_BUILD_ONLY=1 GPU_CHECK_ROWS="" GPU_CHECK_BENCH=0 GPU_CHECK_DIAG=0 GPU_CHECK_DIR="$WORK" \
        OUT="$WORK/check" bash benchmarks/gpu_check.sh >"$WORK/build.txt" 2>&1
    tail -3 "$WORK/build.txt"
    echo "built in $(( SECONDS - t0 )) s"
    [[ -d $WORK/model ]] || { echo "no model built"; cat "$WORK/build.txt"; exit 1; }
    FLAGS="--model $WORK/model --task $WORK/gsm8k_231.jsonl --max-new-tokens 128 --prompts-per-round 8"
    FLAGS+=" --num-generations 8 --device ${GPU_ASYNC_DEVICE:-cuda} --lr 1e-5"
    [[ ${GPU_ASYNC_DEVICE:-cuda} == cuda ]] && FLAGS+=" --dtype bfloat16"
    timeout $(( DEADLINE - (SECONDS - t0) )) "$PY" benchmarks/async_throughput.py --setting gpu \
        --flags "$FLAGS" --batch-size 64 --pairs 1 --rounds "${GPU_ASYNC_ROUNDS:-6}"
    echo "exit $? after $(( SECONDS - t0 )) s"
} 2>&1 | tee "$O/gpu_async.txt"
