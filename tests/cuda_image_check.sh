#!/usr/bin/env bash
# Build docker/Dockerfile.cuda on a stand-in base and check what can be checked without a GPU.
#
# No CUDA base image can be pulled here, so the stand-in for
# nvidia/cuda:13.0.1-runtime-ubuntu24.04 is the Debian base that
# ../shared/tools/container-smoke makes (pass the WORKDIR it used). The real base
# differs (Ubuntu, CUDA libraries, Python 3.12); everything after FROM is the same.
# Checks, as the image's service user: `import cupy` works (a writable kernel
# cache), the packaged lstm.cu compiles with the image's NVRTC for sm_90,
# `--device auto` without a GPU serves on the CPU and logs why, the CPU's compiled steps
# load from the image's prebuilt directory (no compiler in it), health SERVING,
# SIGTERM exits 0, and `--device cuda` without a GPU fails with the reason.
# usage (root, from the checkout): bash tests/cuda_image_check.sh SMOKE_WORKDIR
set -euo pipefail
W=${1:?usage: cuda_image_check.sh CONTAINER_SMOKE_WORKDIR}
export CONTAINERS_CONF=$W/containers.conf
P="podman --root $W/storage --runroot $W/run"
# (every stage is FROM the same base; "AS name" is not part of its tag)
base=docker.io/nvidia/cuda:$(sed -n 's|^FROM nvidia/cuda:\([^ ]*\).*|\1|p' docker/Dockerfile.cuda | sort -u)
$P image exists localhost/python:3.11-slim || { echo "run ../shared/tools/container-smoke $W first"; exit 1; }
$P tag localhost/python:3.11-slim "$base"
$P build --pull=never -f docker/Dockerfile.cuda -t localhost/gradserve:cuda-standin . > "$W/build-cuda.log" 2>&1 \
  || { tail -20 "$W/build-cuda.log"; echo "CUDA image build failed"; exit 1; }
echo "built; size $($P image inspect localhost/gradserve:cuda-standin --format '{{.Size}}') bytes"

$P run --rm -i --network host -v "$PWD/tests/kernels:/checks:ro" localhost/gradserve:cuda-standin \
  python3 - <<'PY'
import sys

sys.path.insert(0, "/checks")
import cupy  # noqa: F401 - fails without a writable CUPY_CACHE_DIR
import nvrtc

from gradserve.kernels import cuda_source

cubin, names = nvrtc.compile_cubin(
    cuda_source.SOURCE.read_text(), cuda_source.name_expressions(), options=("--std=c++14",)
)
print(f"as the service user: cupy imports; packaged lstm.cu -> {len(cubin)} bytes of sm_90 cubin, {len(names)} kernels")
PY

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cid=$($P run -d --network host localhost/gradserve:cuda-standin gradserve serve --host 127.0.0.1 --port "$port" --device auto)
trap '$P rm -f -t 5 "$cid" >/dev/null 2>&1 || true' EXIT
for _ in $(seq 1 60); do
  $P exec "$cid" gradserve health --port "$port" 2>/dev/null | grep -qx SERVING && break
  sleep 1
done
$P exec "$cid" gradserve health --port "$port" | grep -qx SERVING || { $P logs "$cid" | tail; exit 1; }
$P logs "$cid" 2>&1 | grep -q "serving on the CPU because" || { echo "no reason logged for the CPU fallback"; exit 1; }
$P exec "$cid" python3 -c '
import os
from gradserve.kernels import native
lib = native.NATIVE.library()
assert lib is not None, native.NATIVE.failure
assert os.path.realpath(lib._name).startswith("/opt/gradserve/native/"), lib._name
' || { echo "the CPU fallback has no compiled steps from the image"; exit 1; }
$P stop -t 30 "$cid" >/dev/null
code=$($P inspect "$cid" --format '{{.State.ExitCode}}')
echo "--device auto without a GPU: CPU, reason logged, compiled steps loaded, health SERVING, SIGTERM exit $code"
[ "$code" = 0 ]
if out=$($P run --rm --network host localhost/gradserve:cuda-standin \
    gradserve serve --port "$port" --device cuda 2>&1); then
  echo "--device cuda started without a GPU"; exit 1
fi
echo "--device cuda without a GPU: $(tail -1 <<<"$out")"
