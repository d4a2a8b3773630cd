# Fresh clone: `make demo` or `make test` creates .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# PyTorch for the adapter's tests, best effort and bounded: the CPU wheel of torch 2.13.0 is on
	# this project's machines; elsewhere a multi-GB CUDA download is not worth it and those tests skip.
	timeout 300 $(PY) -m pip install --quiet 'torch==2.13.0' numpy || echo "torch not installed: tests/test_torch.py will be skipped"
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

# ruff and mypy at the versions pinned in pyproject's `lint` extra (part of `test`); settings in pyproject.toml
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The issue-#6 comparison over an emulated 400 Mbit/s, 16 ms link (needs root for the network
# namespace and tc; without root it says so and exits 2), then the core overheads.
bench: $(STAMP)
	$(PY) benchmarks/bench_link.py
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info
