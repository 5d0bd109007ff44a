"""The layers hold: the import contracts, what each layer's import loads, and the
definitions that several layers share (the LSTM signature, status codes, dtypes)
agree with the protos."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import grpc
import pytest

from gradserve import codec, dtypes
from gradserve.errors import Code
from gradserve.lstm_signature import LSTMActivations, LSTMGrads, LSTMInputs, LSTMOutputGrads
from gradserve.v1 import lstm_pb2, tensor_pb2

#: Modules no domain import may load.
TRANSPORT = ("grpc", "google.protobuf", "gradserve.v1", "gradserve.client", "gradserve.codec")


def loaded_by(module: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``import module``."""
    code = (
        "import sys, json; before = set(sys.modules); import "
        + module
        + "; print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    "module",
    [
        "gradserve.server.core.tensor_array",
        "gradserve.server.core.sessions",
        "gradserve.server.core.ops.lstm_ops",
        "gradserve.kernels.lstm",
        "gradserve.errors",
        "gradserve",
    ],
)
def test_domain_imports_load_no_transport(module):
    loaded = loaded_by(module)
    leaks = sorted(
        m for m in loaded if any(m == t or m.startswith(t + ".") for t in TRANSPORT)
    ) + sorted(m for m in loaded if m.startswith("gradserve.server.transport"))
    assert not leaks, f"importing {module} loaded {leaks}"


def test_sdk_import_loads_no_server():
    loaded = loaded_by("gradserve.client")
    assert not [m for m in loaded if m.startswith(("gradserve.server", "gradserve.kernels"))]


def test_import_contracts_hold():
    """``.importlinter``'s contracts, as ``make lint`` checks them."""
    lint = subprocess.run(
        [str(pathlib.Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=pathlib.Path(__file__).parents[1],
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "3 kept, 0 broken" in lint.stdout


def _tensor_fields(message) -> tuple[str, ...]:
    return tuple(
        f.name
        for f in message.DESCRIPTOR.fields
        if f.message_type is not None and f.message_type.name in ("TensorInput", "TensorOutput")
    )


def test_lstm_signature_is_the_protos():
    inputs = ("seq_len_max", *LSTMInputs._fields)
    assert _tensor_fields(lstm_pb2.BlockLSTMV2Request) == inputs
    assert _tensor_fields(lstm_pb2.BlockLSTMRequest) == inputs
    assert _tensor_fields(lstm_pb2.BlockLSTMGradRequest) == (
        *inputs,
        *LSTMActivations._fields,
        *LSTMOutputGrads._fields,
    )
    assert _tensor_fields(lstm_pb2.BlockLSTMResponse) == LSTMActivations._fields
    assert _tensor_fields(lstm_pb2.BlockLSTMGradResponse) == LSTMGrads._fields
    assert [f.removesuffix("_grad") for f in LSTMGrads._fields] == list(LSTMInputs._fields)


def test_status_codes_are_grpcs():
    assert [(c.name, c.value) for c in Code] == [(c.name, c.value[0]) for c in grpc.StatusCode]


def test_every_dtype_has_a_wire_enum_and_back():
    named = {v for v in tensor_pb2.DType.values() if v != tensor_pb2.DT_INVALID}
    assert {codec.dtype_to_enum(dt) for dt in dtypes.SUPPORTED} == named
    for dt in dtypes.SUPPORTED:
        assert codec.dtype_from_enum(codec.dtype_to_enum(dt)) == dt
