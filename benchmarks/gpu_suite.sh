#!/usr/bin/env bash
# The GPU suite (benchmarks/gpu_suite.py) on a GPU machine lent for minutes, with PyTorch but no package registry:
# installs the wheels carried in WHEELS (made here by benchmarks/gpu_wheels.sh) without touching the image's own
# packages, runs the parts named (default all) inside BUDGET_S seconds, writes docs/benchmarks.md's gpu-suite section
# and leaves results.json, the page and the logs in OUT.
#
#   bash benchmarks/gpu_wheels.sh .whl --deepspeed                    # here, once
#   OUT=/tmp/gpu BUDGET_S=520 BENCH_COMMIT=<commit> bash benchmarks/gpu_suite.sh [PART ...]   # there
#
# BENCH_COMMIT names the commit in the page's provenance where the tree was copied without its git history.
# Environment: OUT (default /tmp/vagent-gpu), WHEELS (.whl), BUDGET_S (520: with the install and the copy, it ends
# inside a 600 s call), SUITE_DIR (/tmp/vagent-suite: results of an earlier call there are kept and added to),
# CKPT (/tmp/vagent-ckpt: the 3B-shaped checkpoint, built once), SUITE_ARGS (more flags for gpu_suite.py:
# "--device cpu --size tiny" tries this script on a CPU), PYTHON (python3).
set -uo pipefail
OUT=${OUT:-/tmp/vagent-gpu} WHEELS=${WHEELS:-.whl} BUDGET_S=${BUDGET_S:-520}
SUITE_DIR=${SUITE_DIR:-/tmp/vagent-suite} CKPT=${CKPT:-/tmp/vagent-ckpt}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$SUITE_DIR"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    # into a folder of their own, ahead on the path: the image's packages stay as they are
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vagent-site \
        "$WHEELS"/*.whl; then
        export PYTHONPATH=/tmp/vagent-site${PYTHONPATH:+:$PYTHONPATH}
    else  # the parts that need no carried package still run and say what they miss
        echo "warning: the wheels in $WHEELS did not install for $($PY -V 2>&1) (PYTHON_VERSION of gpu_wheels.sh?)" >&2
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi 2>&1; $PY -V; $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__)"; } > "$SUITE_DIR/machine.txt" 2>&1
cat "$SUITE_DIR/machine.txt"
PARTS=("$@")
# the suite's own budget leaves the copy below its seconds; `timeout` is the backstop if a part will not die
timeout $((BUDGET_S + 30)) $PY benchmarks/gpu_suite.py --out "$SUITE_DIR" --checkpoint-dir "$CKPT" --budget "$BUDGET_S" \
    --doc ${SUITE_ARGS:-} ${PARTS:+--parts "${PARTS[@]}"}
rc=$?
cp "$SUITE_DIR/results.json" docs/benchmarks.md "$OUT/" 2>/dev/null
# the logs in one file (the device tool brings back a few files only)
tar czf "$OUT/logs.tar.gz" -C "$SUITE_DIR" --exclude=rows --exclude='grpo-run/rollouts' --exclude='sft-*/checkpoint*' \
    machine.txt $(cd "$SUITE_DIR" && ls -d ./*.log ./*.json grpo-run/metrics.jsonl sft-*/metrics.jsonl 2>/dev/null)
exit $rc
