"""The committed protobuf/gRPC stubs are what protoc makes of protos/, apart from the
version stamps of the tools that made them."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PROTOS = ROOT / "protos"

#: What the generators stamp with their own versions. A new grpcio-tools release
#: changed only these (1.85.1 to 1.85.4) and failed this test on a clean clone; and
#: regenerated, the stubs refuse a grpcio older than the tools that made them.
_STAMPS = (
    re.compile(r"GRPC_GENERATED_VERSION = '[^']*'"),
    re.compile(r"# Protobuf Python Version: \S+"),
    re.compile(r"ValidateProtobufRuntimeVersion\([^)]*\)"),
)


def _unstamped(text: str) -> str:
    for stamp in _STAMPS:
        text = stamp.sub("<stamp>", text)
    return text


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
    stale = [
        str(p)
        for p in generated
        if _unstamped((tmp_path / p).read_text()) != _unstamped((PROTOS / p).read_text())
    ]
    assert not stale, f"stale stubs, run `make proto`: {stale}"


def test_the_stubs_need_no_newer_grpcio_than_the_package_asks_for():
    """A stub refuses to load under a grpcio older than its GRPC_GENERATED_VERSION:
    regenerated with a newer grpcio-tools, they must not pass the package's own lower
    bound, or an install that satisfies it fails at import."""
    wanted = re.search(r'"grpcio>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert wanted is not None
    floor = tuple(int(x) for x in wanted.group(1).split("."))
    for stub in PROTOS.rglob("*_pb2_grpc.py"):
        stamp = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", stub.read_text())
        assert stamp is not None, stub
        assert tuple(int(x) for x in stamp.group(1).split(".")) <= floor, stub
