# Two entry points: `make demo` and `make test`. Both install what they need first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-deploy clean

install: $(STAMP)

# torch is installed first and pinned to the CPU wheel when no torch is importable in the
# venv: an unpinned `torch` would pull a multi-GB CUDA build. A GPU box may pre-install its own.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: install
	$(VENV)/bin/backfit demo

# two workers (the CI box has 2 cores; each runs torch on one thread, tests/conftest.py), each
# test file on one worker (its module fixtures built once): 13 min here where one took 29.5
test: install
	$(PY) -m pytest -q -x -n 2 --dist loadfile --durations=15 -m "not deploy"

# replicas behind the router as real processes (docs/DEPLOY.md): installs the router wheel (smg)
test-deploy: install
	$(PY) -m pip install -q -e ".[test,deploy]"
	$(PY) -m pytest -q -x -n 0 -m deploy tests/deploy

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
