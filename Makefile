PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-gguf test-bridge docs bench bench-ab vllm-env gguf-env bridge-env lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP) vllm-env
	VLLM_VENV=$(VLLM_VENV) $(BIN)/python -m mconvert.demo

test: $(STAMP) docs gguf-env bridge-env
	GGUF_VENV=$(GGUF_VENV) BRIDGE_VENV=$(BRIDGE_VENV) $(BIN)/python -m pytest -q --durations=25 tests

# The user docs (mkdocs.yml, docs/); --strict fails on a broken link, anchor or nav entry.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python bench/bench.py

# The same conversions by version A (a git ref) and by this tree, interleaved in one run: make bench-ab A=main~5
bench-ab: $(STAMP)
	$(BIN)/python bench/ab.py --a $(A)

# vLLM pins transformers 5.x, so it gets its own venv (outside the repo; reused when present).
VLLM_VENV ?= $(HOME)/.cache/mconvert/vllm-venv
vllm-env:
	PY=$(PY) bash mconvert/validators/vllm_env.sh $(VLLM_VENV)

# llama.cpp (llama-cpp-python, built from source) gets its own venv too (outside the repo; reused when present).
GGUF_VENV ?= $(HOME)/.cache/mconvert/gguf-venv
gguf-env:
	PY=$(PY) bash mconvert/validators/gguf_env.sh $(GGUF_VENV)

# Megatron-Bridge (with megatron-core 0.19 and transformers 5) gets its own venv too (outside the repo; reused when
# present): wheels only.
BRIDGE_VENV ?= $(HOME)/.cache/mconvert/bridge-venv
bridge-env:
	PY=$(PY) bash mconvert/validators/bridge_env.sh $(BRIDGE_VENV)

# The Megatron-Bridge interop tests run Megatron-Bridge itself: the env is built first when absent.
test-bridge: $(STAMP) bridge-env
	BRIDGE_VENV=$(BRIDGE_VENV) $(BIN)/python -m pytest -q -m bridge tests/convert/megatron/test_bridge.py

# The GGUF tests run the files in llama.cpp itself: the env is built first when absent.
test-gguf: $(STAMP) gguf-env
	GGUF_VENV=$(GGUF_VENV) $(BIN)/python -m pytest -q -m gguf tests/convert/deploy/test_gguf.py tests/convert/deploy/test_gguf_peer.py

lint: $(STAMP)
	$(BIN)/ruff check mconvert tests bench

clean:
	rm -rf $(VENV) build site *.egg-info
