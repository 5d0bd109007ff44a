"""The committed protobuf/gRPC stubs are exactly what protoc makes of protos/."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PROTOS = ROOT / "protos"


def test_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTOS}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *sources,
        ],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (PROTOS / p).read_bytes()]
    assert not stale, f"stale stubs, run `make proto`: {stale}"
