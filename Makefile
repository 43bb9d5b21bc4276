# Kaizen: `make demo` runs the whole loop on the embedded default; `make test` runs the tests.
# Everything installs into .venv. torch is pinned and installed first, by itself, so that pip
# never resolves an unpinned torch (which would pull gigabytes of CUDA packages on CPU machines).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kaizen-installed
TINY   := .cache/tiny-model
PYTEST_ARGS ?=

.PHONY: all install demo test test-unit bench tiny-model clean

all: test

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[server,test]'
	touch $(STAMP)

install: $(STAMP)

$(TINY)/config.json: | $(STAMP)
	$(BIN)/kaizen tiny-model $(TINY)

tiny-model: $(TINY)/config.json

demo: $(STAMP)
	$(BIN)/kaizen demo --config configs/demo.yaml

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

bench: $(STAMP) $(TINY)/config.json
	$(BIN)/python -m tests.bench.run

clean:
	rm -rf $(VENV) .cache runs .pytest_cache
