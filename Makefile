PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP_TEST := $(VENV)/.stamp-test
STAMP_EXP := $(VENV)/.stamp-experiments

.PHONY: test demo fuzz lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP_TEST): setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(STAMP_EXP): setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test,experiments]'
	touch $@

# The whole suite. The experiments extra is installed too so that the
# experiment scripts' --quick paths are tested.
test: $(STAMP_TEST) $(STAMP_EXP)
	$(PY) -m pytest -n 2 -q tests

demo: $(STAMP_EXP)
	$(PY) -m experiments.demo --quick --out results

# Random programs against plain JAX (make test runs 2,000 of them): prints the
# counts per construct and the first failures; exits 1 if a program was wrong.
FUZZ_PROGRAMS ?= 20000
FUZZ_SEED ?= 1
FUZZ_JOBS ?= 2
fuzz: $(STAMP_TEST)
	$(PY) -m tests.fuzz_programs --programs $(FUZZ_PROGRAMS) --seed $(FUZZ_SEED) \
		--jobs $(FUZZ_JOBS)

lint: $(STAMP_TEST)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check revnet experiments tests
	$(VENV)/bin/ruff format --check revnet experiments tests

clean:
	rm -rf $(VENV) results .pytest_cache
