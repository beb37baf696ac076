#!/usr/bin/env bash
# The prepared GPU check: one NVIDIA GPU, no network, at most 8 minutes (bench/gpu_check.py says what it
# runs: SmolLM2-sized and tiny GLM targets with random weights captured by the HF engine on CUDA, each
# checked with `capture shards check` against a CPU reference, then tokens/s and capture / plain forward).
#
# The GPU machine has torch with CUDA, transformers and pyarrow; the few other wheels come along in .whl/:
#   make gpu-wheels                                  # here, with network (ignored by git: .whl/)
#   bash bench/gpu_check.sh | tee bench/gpu_check.out   # there, from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
# the first line of the recording: the command that reproduces it (bench/harness.py's header, in shell)
echo "\$ ${PYTHON:+PYTHON=$PYTHON }${DEVICE:+DEVICE=$DEVICE }bash bench/gpu_check.sh${*:+ $*}   # $(date -u '+%Y-%m-%d %H:%M UTC')"
PY=${PYTHON:-python3}
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --find-links .whl zstandard xxhash ijson jinja2 numba llvmlite 2>&1 | tail -3 || true
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 480 "$PY" -u bench/gpu_check.py --device "${DEVICE:-cuda}" "$@" \
    2> >(grep -v "Loading weights\|Writing model" >&2)
