#!/usr/bin/env bash
# The GPU check: run once on a machine with one CUDA GPU (about 5 to 10 minutes).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # default OUT_DIR: gpu-check-<time>
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh out   # another interpreter
#
# 1. an interpreter with torch's CUDA build: $PYTHON, else .venv (made here when missing,
#    with torch==2.13.0 from PyPI, which is the CUDA build, and loopgate's extras the
#    checks need);
# 2. the CUDA-only tests (pytest marker `gpu`, tests/test_cuda_ipc_gpu.py): CUDA IPC
#    handles across processes, a whole `loopgate up` run at 4096 envs on the GPU, weights
#    by handle against host buckets; then the CPU-side CUDA IPC tests, as a regression run;
# 3. the `gpu` bench suite: weights.sync_s.<size>.cuda_ipc against .host and
#    obs.infer_us.n4096.cuda_ipc against .host (benchmarks/gpu_inference.py);
# 4. the inference backends on the GPU (python -m benchmarks.gpu_inference).
#
# Writes OUT_DIR/environment.txt, gpu-tests.xml and cpu-side-tests.xml (JUnit),
# gpu-bench.json (loopgate bench records) and gpu-inference.json. Exits non-zero if a
# step failed; the later steps still run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
export MUJOCO_GL="${MUJOCO_GL:-egl}"
PY="${PYTHON:-.venv/bin/python}"

if [ ! -x "$PY" ]; then
  echo "== making .venv (torch's CUDA build and loopgate's gateway, train and test extras)"
  python3 -m venv .venv || exit 1
  .venv/bin/pip install --quiet --upgrade pip || exit 1
  .venv/bin/pip install --quiet "torch==2.13.0" || exit 1
  .venv/bin/pip install --quiet -e ".[gateway,train,venv-test]" || exit 1
  PY=.venv/bin/python
fi

{
  date -u
  nvidia-smi || echo "nvidia-smi: not found"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); [print(i, torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]'
  git rev-parse HEAD 2>/dev/null
} >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "torch sees no CUDA device here (see $OUT/environment.txt): nothing to check" >&2
  exit 2
fi

failed=()
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  local started=$SECONDS
  if timeout "$limit" "$@"; then
    echo "== $name: ok ($((SECONDS - started)) s)"
  else
    echo "== $name: FAILED ($((SECONDS - started)) s)"
    failed+=("$name")
  fi
}

step "CUDA-only tests" 480 "$PY" -m pytest -m gpu tests/test_cuda_ipc_gpu.py -q -rs -p no:cacheprovider \
  --junitxml "$OUT/gpu-tests.xml"
step "CUDA IPC tests of the CPU side" 180 "$PY" -m pytest tests/test_cuda_ipc.py tests/test_cuda_ipc_weights.py \
  tests/test_cuda_ipc_path.py -q -rs -p no:cacheprovider --junitxml "$OUT/cpu-side-tests.xml"
step "gpu bench suite" 300 "$PY" -m gateway bench --only gpu --repeats 3 --json "$OUT/gpu-bench.json"
step "inference backends on the GPU" 180 "$PY" -m benchmarks.gpu_inference --iters 200 --json "$OUT/gpu-inference.json"

echo "results in $OUT/"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
