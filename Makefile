PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP_TEST := $(VENV)/.stamp-test
STAMP_EXP := $(VENV)/.stamp-experiments

.PHONY: test demo lint clean

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

lint: $(STAMP_TEST)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check revnet experiments tests
	$(VENV)/bin/ruff format --check revnet experiments tests

clean:
	rm -rf $(VENV) results .pytest_cache
