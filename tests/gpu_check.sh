#!/usr/bin/env bash
# `make gpu-check`: on a CUDA machine, run the GPU tests and the GPU benchmark and
# write everything to one folder (default results/gpu-check).
#   tests.log / junit.xml  every LSTM test with the CUDA twins, and the server on --device cuda
#   bench.log / bench.json our CUDA LSTM vs cuDNN (torch.nn.LSTM, if torch is installed)
set -uo pipefail
out=${1:-results/gpu-check}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1
status=0
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
  "$py" -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
} > "$out/device.txt" 2>&1 || status=1
GRADSERVE_TEST_DEVICE=cuda "$py" -m pytest -q tests/kernels tests/server/test_lstm_rpc.py \
  tests/examples --junitxml "$out/junit.xml" 2>&1 | tee "$out/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$py" tests/benchmarks/bench_lstm_gpu.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu-check: results in $out (status $status)"
exit $status
