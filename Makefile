# Two ends of the supported JAX range, each in its own venv:
#   JAX=oldest (the default): jax 0.10.2 on $(PYTHON) (Python 3.11 or later), in .venv;
#   JAX=latest: the newest JAX revnet supports (0.12.x), on a Python >= 3.12
#     that .ci/python-latest finds (PATH, pyenv) or builds from Debian's
#     sources, in .venv-latest. For example `make test JAX=latest`.
PYTHON ?= python3
JAX ?= oldest
ifeq ($(JAX),latest)
VENV := .venv-latest
BASE_PYTHON = $(shell .ci/python-latest)
JAX_REQ :=
else ifeq ($(JAX),oldest)
VENV := .venv
BASE_PYTHON = $(PYTHON)
JAX_REQ := 'jax==0.10.2' 'jaxlib==0.10.2'
else
$(error JAX=$(JAX): use JAX=oldest (jax 0.10.2) or JAX=latest (the newest supported))
endif
PY := $(VENV)/bin/python
STAMP_TEST := $(VENV)/.stamp-test
STAMP_EXP := $(VENV)/.stamp-experiments

.PHONY: test test-all test-experiments test-next demo demo-full docs chromium fuzz lint clean

$(PY):
	@base="$(BASE_PYTHON)"; test -n "$$base" || { echo "no Python for JAX=$(JAX)" >&2; exit 1; }; \
	echo "making $(VENV) with $$base"; "$$base" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Haiku is an extra too (revnet.blocks); the test extra brings it, as the
# tests import it throughout.
$(STAMP_TEST): setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test,haiku]' $(JAX_REQ)
	touch $@

# The front doors' frameworks come with the experiments extra, so that `make
# test` and CI run their tests; without Flax or Equinox those tests skip,
# naming the extra.
# With the oldest JAX, the simulation extra too (jax-md, fdtdx, diffrax): the
# simulation examples' and peers' tests run there, and skip, naming the extra,
# where it is absent.
ifeq ($(JAX),oldest)
EXP_EXTRAS := test,experiments,haiku,nnx,equinox,docs,simulation
else
EXP_EXTRAS := test,experiments,haiku,nnx,equinox,docs
endif
$(STAMP_EXP): setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[$(EXP_EXTRAS)]' $(JAX_REQ)
	touch $@

# Headless Chromium (Debian's package) for the slow tier's test that opens the
# built documentation site (tests/project/test_docs_site.py).
CHROMIUM := $(shell command -v chromium-headless-shell chromium 2>/dev/null | head -1)
chromium:
ifeq ($(CHROMIUM),)
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		chromium-headless-shell >/dev/null
endif

# The fast tier: every test not marked `slow` (pyproject.toml's markers: the
# subprocess, 8-device, multi-process, depth-128, fuzz, example and benchmark
# runs). The experiments extra is installed too: the examples' state files and
# the benchmarks' helpers are tested here.
test: $(STAMP_TEST) $(STAMP_EXP)
	$(PY) -m pytest -n 2 -q -m "not slow" tests

# Everything: the fast tier and the slow one.
test-all: $(STAMP_TEST) $(STAMP_EXP) chromium
	$(PY) -m pytest -n 2 -q -m "not experiments" tests

# Every `python -m experiments.NAME --quick`, to the end (tens of minutes on
# 2 cores: outside test-all; test-all runs each benchmark's --tiny).
test-experiments: $(STAMP_TEST) $(STAMP_EXP)
	$(PY) -m pytest -q -m experiments tests/project/test_experiments_quick.py

# The documentation site, in strict mode: a broken link, a missing page or a
# public name on no API page fails (docs/hooks/). Open site/index.html. No -q:
# mkdocs 1.6's -q lowers its logger to ERROR, so warnings would never reach
# --strict and the build would pass with them (tests/project/test_docs_site.py).
docs: $(STAMP_EXP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The core, loops and blocks suites under JAX's opt-in "next primitive" flags,
# which reroute jax.custom_vjp, jax.checkpoint and lax.scan to JAX's hijax
# primitives, compiled with XLA's full optimisations (the other tiers compile
# without them, tests/conftest.py). A test whose plain JAX reference fails
# inside JAX under a flag is reported as skipped with JAX's message
# (tests/next_flags.py). Two passes, to keep CI's time: JAX_CUSTOM_VJP3 with
# JAX_REMAT3 (as later JAX releases turn them on together) over NEXT_TESTS,
# then JAX_SCAN3 alone over the suites of scans (NEXT_SCAN_TESTS; under it
# plain JAX cannot differentiate or vmap some scans, and those tests skip). The
# Haiku stack's own files stand for tests/doors/haiku, and the inverse rules of
# single primitives (tests/rules), which the flags do not touch, run once in
# test-all; so do the slow tier's depth-128 memory, exact bytes and depth-32
# decision programs (NEXT_MARK="" runs them here too).
# tests/project/test_next_primitives.py sets each flag itself and runs in test-all.
NEXT_TESTS ?= tests/core/test_invertible.py tests/core/test_ivjp.py \
	tests/engine/test_engine.py tests/engine/test_decisions.py \
	tests/loops/test_while_loop.py tests/loops/test_scan.py tests/loops/test_modes.py \
	tests/doors/haiku/test_sequence.py tests/doors/haiku/test_coupling.py
NEXT_SCAN_TESTS ?= tests/loops/test_scan.py tests/loops/test_modes.py \
	tests/core/test_invertible.py
NEXT_MARK ?= not slow
NEXT_RUN = JAX_DISABLE_MOST_OPTIMIZATIONS=0 $(PY) -m pytest -n 2 -q -rs -m "$(NEXT_MARK)"
test-next: $(STAMP_TEST)
	@status=0; \
	echo "== JAX_CUSTOM_VJP3=1 JAX_REMAT3=1"; \
	JAX_CUSTOM_VJP3=1 JAX_REMAT3=1 $(NEXT_RUN) $(NEXT_TESTS) || status=1; \
	echo "== JAX_SCAN3=1"; \
	JAX_SCAN3=1 $(NEXT_RUN) $(NEXT_SCAN_TESTS) || status=1; \
	exit $$status

# The demo, in results/REPORT.md with one plot (benchmarks/demo.py): the digits
# RevNet trained reversible and standard (10 epochs, the twins' largest gradient
# difference at the same parameters), compiled memory of a training step
# against depth (reversible flat, standard backprop linear, per-layer
# jax.checkpoint between), and the step-time ratio at one size (a median).
# Measured with the venv already installed: 3 min 21 s wall (89 s CPU, user +
# sys) on 2 cores shared with other jobs (load average 7 to 9); 73 s wall at 4
# epochs under less load. A fresh clone adds the install (not timed here).
demo: $(STAMP_EXP)
	$(PY) -m benchmarks.demo --out results

# Every benchmark of benchmarks/__init__.py at its --quick size, each in its own
# process, into results/full/REPORT.md. Not timed with all 12: the 9 there were
# before benchmarks.exact, .flows and .budget were added (memory, speed,
# train, numerics, loops, overhead, decisions, sharding, front_doors) took
# 22 min 43 s on 2 cores from a fresh clone, install included (then `make
# demo`); exact and flows run on top of that. On 2 cores shared with other
# jobs (load 5 to 9) those 9 took far longer: memory 9.3 min, speed 9.8, train
# 1.0, numerics 2.7, and loops was stopped unfinished after 26 min (49 min in
# all by then).
demo-full: $(STAMP_EXP)
	$(PY) -m benchmarks.run --quick --out results/full

# Random programs against plain JAX (make test-all runs 1,000 of them): prints the
# counts per construct and the first failures; exits 1 if a program was wrong.
FUZZ_PROGRAMS ?= 20000
FUZZ_SEED ?= 1
FUZZ_JOBS ?= 2
FUZZ_LOG_DETS ?= 10000
fuzz: $(STAMP_TEST)
	$(PY) -m tests.fuzz --programs $(FUZZ_PROGRAMS) --seed $(FUZZ_SEED) \
		--jobs $(FUZZ_JOBS) --log-dets $(FUZZ_LOG_DETS)

lint: $(STAMP_TEST)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check revnet benchmarks examples experiments tests docs/hooks
	$(VENV)/bin/ruff format --check revnet benchmarks examples experiments tests docs/hooks

clean:
	rm -rf .venv .venv-latest results site .pytest_cache build dist *.egg-info
