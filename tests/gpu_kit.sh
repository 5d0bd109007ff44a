#!/usr/bin/env bash
# `make gpu-kit`: wheels for running `make gpu-check` on a GPU machine with no network.
#
# The lent GPU machine (see README, "GPU check") has Python 3.12 with numpy, cupy-cuda13x,
# nvidia-cuda-nvrtc, torch, pytest, hypothesis and threadpoolctl, but no package index.
# This puts gradserve's own wheel and its gRPC/protobuf runtime, at the versions the
# local venv was tested with, into .whl/; gpu_check.sh installs them from there.
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
kit_python=${KIT_PYTHON:-3.12}
kit=${KIT_DIR:-.whl}
rm -rf "$kit"
mkdir -p "$kit"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$kit" .
mapfile -t pins < <("$py" -m pip freeze | grep -iE \
  '^(grpcio|grpcio-health-checking|grpcio-reflection|grpcio-status|protobuf|googleapis-common-protos|prometheus[-_]client|typing[-_]extensions)==')
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$kit_python" \
  --implementation cp "${platforms[@]}" -d "$kit" "${pins[@]}"
ls -1 "$kit"
du -sh "$kit"
