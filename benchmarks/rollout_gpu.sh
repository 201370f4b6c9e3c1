#!/usr/bin/env bash
# The rollout engine's GPU measurement in one command, for a machine lent for a few minutes: the GPU tests, then on
# Qwen2.5-VL-3B's shapes with Qwen's vocabulary in bf16 the engine and decode tables (benchmarks/rollout.py: CUDA
# graphs, eager steps and the engine before the slot KV cache side by side) and the decode profiles
# (benchmarks/rollout_profile.py, with graphs against the baseline, then eager), written into docs/benchmarks.md
# ("On a GPU"). Logs and the page go to $OUT.
#
#   git clone -q . .base && git -C .base checkout -q afb217c   # the baseline: a whole clone (a worktree's .git
#                                                              # points outside the tree and does not travel)
#   OUT=/tmp/gpu BENCH_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/rollout_gpu.sh
#
# BENCH_COMMIT names the commit in the tables' provenance; set it from here when the tree is copied to the machine
# that runs it (there, git may report another HEAD).
#
# Environment: OUT (default /tmp/vagent-gpu), BASE (default .base), DEVICE (cuda), SIZE (3b), DTYPE (bfloat16),
# BUDGET_S (seconds the whole script may take, default 580: each step's limit is cut to what is left of it).
set -uo pipefail
OUT=${OUT:-/tmp/vagent-gpu} BASE=${BASE:-.base} DEVICE=${DEVICE:-cuda} SIZE=${SIZE:-3b} DTYPE=${DTYPE:-bfloat16}
BUDGET_S=${BUDGET_S:-580} CKPT=${CKPT:-/tmp/vagent-bench-ckpt}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}

step() {  # step NAME CAP_S COMMAND...: run it under min(CAP_S, what is left of the budget), log to $OUT/NAME.log
    local name=$1 cap=$2 left=$((BUDGET_S - SECONDS - 10))
    shift 2
    ((left < cap)) && cap=$left
    if ((cap < 20)); then echo "== $name: skipped, ${left}s of the budget left"; return 1; fi
    echo "== $name (limit ${cap}s, at ${SECONDS}s): $*"
    timeout "$cap" "$@" > >(tr '\r' '\n' | grep -v 'it/s' > "$OUT/$name.log") 2>&1
    local rc=$?
    sleep 1
    tail -n 40 "$OUT/$name.log"
    echo "== $name: exit $rc after ${SECONDS}s"
    return $rc
}

{ nvidia-smi 2>&1; $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > "$OUT/machine.txt"
[[ $DEVICE == cuda ]] && step gpu-tests 90 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_model.py \
    tests/test_rollout_backend.py
step rollout 330 $PY benchmarks/rollout.py --size "$SIZE" --vocab qwen --device "$DEVICE" --dtype "$DTYPE" --repeat 1 \
    --checkpoint-dir "$CKPT" --baseline "$BASE" --doc
step profile 120 $PY benchmarks/rollout_profile.py --size "$SIZE" --vocab qwen --device "$DEVICE" --dtype "$DTYPE" \
    --rows 16 --checkpoint-dir "$CKPT" --baseline "$BASE" --doc
step profile-eager 80 $PY benchmarks/rollout_profile.py --size "$SIZE" --vocab qwen --device "$DEVICE" \
    --dtype "$DTYPE" --rows 16 --checkpoint-dir "$CKPT" --eager --doc
cp docs/benchmarks.md "$OUT/"
echo "== done after ${SECONDS}s"
