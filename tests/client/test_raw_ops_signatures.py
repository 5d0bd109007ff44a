"""``client.raw_ops`` against TensorFlow 2.21's own ``tf.raw_ops`` signatures.

The file was recorded from TensorFlow (``golden/record_raw_ops_signatures.py``): every
op the SDK mirrors must take TensorFlow's arguments in TensorFlow's order with its
defaults, and return several outputs as a named tuple in TensorFlow's output order.
The SDK's own additions are keyword-only (``keep``), so a call written for
``tf.raw_ops`` runs unchanged.
"""

from __future__ import annotations

import inspect
import json
import pathlib
import typing

import pytest

from gradserve.client import _raw_ops

SIGNATURES = json.loads(
    (pathlib.Path(__file__).parents[1] / "golden" / "raw_ops_signatures.json").read_text()
)["ops"]


@pytest.mark.parametrize("op", sorted(SIGNATURES))
def test_arguments_and_defaults_are_tensorflows(op):
    method = getattr(_raw_ops.RawOps, op)
    params = list(inspect.signature(method).parameters.values())[1:]  # without self
    positional = [p for p in params if p.kind is not p.KEYWORD_ONLY]
    assert [p.name for p in positional] == [p[0] for p in SIGNATURES[op]["params"]]
    for p, want in zip(positional, SIGNATURES[op]["params"]):
        if len(want) == 1:
            assert p.default is p.empty, f"{p.name} is required in TensorFlow"
        else:
            assert p.default == want[1] and type(p.default) in (type(want[1]), float), p.name


@pytest.mark.parametrize("op", sorted(SIGNATURES))
def test_outputs_in_tensorflows_order(op):
    outputs = SIGNATURES[op]["outputs"]
    returns = typing.get_type_hints(getattr(_raw_ops.RawOps, op)).get("return")
    if len(outputs) > 1:
        assert list(returns._fields) == outputs
    else:
        assert not hasattr(returns, "_fields")  # one output: the value itself
