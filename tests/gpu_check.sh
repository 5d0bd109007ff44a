#!/usr/bin/env bash
# `make gpu-check`: on a CUDA machine, run the GPU tests and the GPU benchmark and
# write everything to one folder (default results/gpu-check).
#   device.txt             GPU, driver, CuPy, and where gradserve was imported from
#   tests.log / junit.xml  every LSTM test with the CUDA twins (eager and CUDA graphs), the
#                          server on --device cuda, with --cuda-graphs off and on, and the
#                          device-resident tests (host<->GPU copies, on the stand-in cupy)
#   bench.log / bench.json our CUDA LSTM vs cuDNN (torch.nn.LSTM, if torch is installed)
#
# Offline: with a .whl/ folder (made by `make gpu-kit` where there is a package index)
# it installs gradserve and its gRPC runtime from there into a private folder and runs
# on the machine's own python3 (which brings numpy, cupy, torch, pytest); else it uses
# $PYTHON (default .venv/bin/python) as it is.
set -uo pipefail
out=${1:-results/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  site=${TMPDIR:-/tmp}/gradserve-gpu-site
  py=${PYTHON:-python3}
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
    .whl/*.whl > "$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
  py=${PYTHON:-.venv/bin/python}
fi
# The twin of every LSTM test runs on this device; "cpu" rehearses the script without a GPU.
export GRADSERVE_TEST_DEVICE=${GRADSERVE_TEST_DEVICE:-cuda}
# Each phase has its own time limit (seconds; SIGINT, so pytest still writes its summary),
# so that one phase that hangs on the GPU leaves time for the others: the device tool
# allows 540 s for the whole script.
limit() { timeout --signal=INT --kill-after=10 "$@"; }
TESTS_S=${TESTS_S:-240} GRAPHS_S=${GRAPHS_S:-100} BENCH_S=${BENCH_S:-150}
status=0
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
  "$py" -c "import gradserve, grpc, google.protobuf as pb, numpy; print('gradserve', gradserve.__file__, 'grpc', grpc.__version__, 'protobuf', pb.__version__, 'numpy', numpy.__version__)"
  "$py" -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
} > "$out/device.txt" 2>&1 || status=1
cat "$out/device.txt"
limit "$TESTS_S" "$py" -m pytest -q tests/kernels tests/server/test_lstm_rpc.py \
  tests/server/test_lstm_inputs_property.py tests/server/test_lstm_device_resident.py \
  tests/examples --junitxml "$out/junit.xml" 2>&1 | tee "$out/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# The served LSTM again, with the server replaying CUDA graphs (--cuda-graphs on).
GRADSERVE_TEST_CUDA_GRAPHS=1 limit "$GRAPHS_S" "$py" -m pytest -q tests/server/test_lstm_rpc.py \
  tests/server/test_lstm_inputs_property.py tests/examples \
  2>&1 | tee -a "$out/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ "$GRADSERVE_TEST_DEVICE" = cuda ]; then
  limit "$BENCH_S" "$py" tests/benchmarks/bench_lstm_gpu.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "GPU benchmark skipped: rehearsal on $GRADSERVE_TEST_DEVICE" | tee "$out/bench.log"
fi
echo "gpu-check: results in $out (status $status)"
exit $status
