"""Every TensorArray trace recorded from TensorFlow 2.21, replayed through a real server.

The 21 shared traces (``tensor_array_traces.json``) and our own: curated ones and 400
random ones (``tensor_array_traces_random.json``, by ``record_tensor_array_traces.py``),
and the bfloat16 and string traces, curated and 40 random each, with the zero-element
Gather and Concat ones (``tensor_array_traces_dtypes.json``, by
``record_tensor_array_dtype_traces.py``).
Each step's value must match exactly (dtype, shape, bytes; for strings each element's
bytes) and each error must
be the same TensorFlow error class with the same message (array names and
TensorFlow's op-location wrapping normalised away). Where TensorFlow killed its own
process (``tf_crashed``: each time a Concat of a grad array with unwritten elements,
SIGSEGV in TensorFlow 2.21), ours answers as README "Semantics" says (``TF_CRASHED``),
and the session goes on serving. TensorFlow has no zeros of strings: reading an
unwritten string element (whose shape holds elements) is refused, by both.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from gradserve import errors
from tests.golden.trace_format import expected, normalise, resolve, same_tensor

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
TRACES = {
    name: steps
    for file in (
        "tensor_array_traces.json",
        "tensor_array_traces_random.json",
        "tensor_array_traces_dtypes.json",
    )
    for name, steps in json.loads((GOLDEN / file).read_text())["traces"].items()
}

pytestmark = pytest.mark.golden

_CONCAT_MISMATCH = (
    "TensorArray was passed element_shape_except0 {} but index 0 has (excepting dimension"
    " 0) shape: {} which does not match."
)
#: What ours answers where TensorFlow 2.21 died: the Concat of a grad array whose
#: elements are (some or all) unwritten. Unwritten grad elements are zeros of the
#: forward's element shape (after any ``shape_to_prepend``), as Read and Gather return
#: them; so the Concat is the zeros, or TensorFlow's own error where the elements it
#: would have had cannot be concatenated as asked.
TF_CRASHED = {
    # size 3, element [0] float64: three empty elements.
    "random_073": {"value": np.zeros(0, np.float64), "lengths": [0, 0, 0]},
    # size 2, element [2] int32.
    "random_146": {"value": np.zeros(4, np.int32), "lengths": [2, 2]},
    # size 3, element [2] float32 (the forward's write is not the grad's).
    "random_209": {"value": np.zeros(6, np.float32), "lengths": [2, 2, 2]},
    # size 0: no elements; the shape is [0] + element_shape_except0.
    "random_222": {"value": np.zeros((0, 1, 2), np.int32), "lengths": []},
    # size 2, element [1, 2] float32.
    "random_241": {"value": np.zeros((2, 2), np.float32), "lengths": [1, 1]},
    # Grad elements [1] + [1, 2]: not [?, 2].
    "random_228": {"error": _CONCAT_MISMATCH.format("[2]", "[1,2]")},
    # Grad elements [2, 1] + [1, 2]: not [?, 2].
    "random_249": {"error": _CONCAT_MISMATCH.format("[2]", "[1,1,2]")},
    # Grad elements [1] + [2, 3] (the shape the forward's writes fixed): not [?, 3].
    "random_383": {"error": _CONCAT_MISMATCH.format("[3]", "[2,3]")},
    # Scalar elements cannot be concatenated.
    "random_252": {
        "error": "Concat saw a scalar shape at index 0 but requires at least vectors.  "
        "Did you mean to call pack?"
    },
    # size 2, element [2] string, index 1 unwritten: TensorFlow has no zeros of strings
    # (its Read and Gather of that element refuse with this message), so neither has
    # the Concat.
    "string_grad_concat_unwritten": {
        "error": "tensor_array::TensorSetZero type not supported: string"
    },
}


def check_value(got, expect: dict) -> None:
    want = expected(expect)
    got = np.asarray(got)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert same_tensor(got, want), (got, want)


def check_error(
    op, kwargs: dict, error_class: type, message: str, where: str, exact: bool = False
) -> None:
    """``op`` fails with ``error_class`` and a message containing ``message`` once
    normalised (``exact``: the message itself)."""
    try:
        got = op(**kwargs)
    except error_class as e:
        if (str(e) == message) if exact else (message in normalise(str(e))):
            return
        raise AssertionError(f"{where}: TensorFlow: {message!r}; gradserve: {e!r}") from e
    pytest.fail(f"{where}: did not raise {error_class.__name__}: {message!r}; got {got!r}")


@pytest.mark.parametrize("name", sorted(TRACES))
def test_trace(client, name):
    env: dict = {}
    for number, step in enumerate(TRACES[name]):
        where = f"{name} step {number} {step['op']}"
        op = getattr(client.raw_ops, step["op"])
        expect = step["expect"]
        kwargs = resolve(step["args"], env)
        if "tf_crashed" in expect:
            want = TF_CRASHED[name]
            if "error" in want:
                check_error(
                    op, kwargs, errors.InvalidArgumentError, want["error"], where, exact=True
                )
            else:
                result = op(**kwargs)
                value = np.asarray(result.value)
                assert (value.dtype, value.shape) == (want["value"].dtype, want["value"].shape)
                assert same_tensor(value, want["value"])
                np.testing.assert_array_equal(result.lengths, want["lengths"])
                assert result.lengths.dtype == np.int64
                assert result.lengths.shape == (len(want["lengths"]),)
            assert client.raw_ops.StopGradient(input=np.float32(2.5)) == 2.5  # still serving
            return
        if "error" in expect:
            error_class = getattr(errors, expect["error"])
            check_error(op, kwargs, error_class, normalise(expect["message"]), where)
            return
        result = op(**kwargs)
        if step["op"] == "TensorArrayConcatV3":
            check_value(result.value, expect)
            np.testing.assert_array_equal(result.lengths, expect["lengths"])
            assert result.lengths.dtype == np.int64
        elif "value" in expect:
            check_value(result, expect)
        outs = step.get("out", [])
        if outs:
            results = result if isinstance(result, tuple) else (result,)
            env.update(zip(outs, results))


def test_tensorflow_crashed_on_grad_concats_only():
    """``TF_CRASHED`` lists every trace that killed TensorFlow, and each died at the
    Concat of an array made by TensorArrayGradV3 or TensorArrayGradWithShape."""
    crashed = {n for n, steps in TRACES.items() if "tf_crashed" in steps[-1]["expect"]}
    assert crashed == set(TF_CRASHED)
    for name in crashed:
        *before, last = TRACES[name]
        assert last["op"] == "TensorArrayConcatV3"
        grads = {
            s["out"][0] for s in before if s["op"].startswith("TensorArrayGrad") and "out" in s
        }
        assert last["args"]["handle"][1:] in grads, name
        assert all("tf_crashed" not in s["expect"] for s in before)
