"""Every TensorArray trace recorded from TensorFlow 2.21, replayed through a real server.

The 21 shared traces (``tensor_array_traces.json``) and our own: curated ones and 400
random ones (``tensor_array_traces_random.json``, by ``record_tensor_array_traces.py``).
Each step's value must match exactly (dtype, shape, bytes) and each error must
be the same TensorFlow error class with the same message (array names and
TensorFlow's op-location wrapping normalised away). Where TensorFlow killed its own
process (``tf_crashed``), ours must answer, with a result or a typed error, and the
session must go on serving.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from gradserve import errors
from tests.golden.trace_format import normalise, resolve

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
TRACES = {
    name: steps
    for file in ("tensor_array_traces.json", "tensor_array_traces_random.json")
    for name, steps in json.loads((GOLDEN / file).read_text())["traces"].items()
}


def check_value(got, expect: dict) -> None:
    want = np.asarray(expect["value"], dtype=expect["dtype"]).reshape(expect["shape"])
    got = np.asarray(got)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("name", sorted(TRACES))
def test_trace(client, name):
    env: dict = {}
    for step in TRACES[name]:
        op = getattr(client.raw_ops, step["op"])
        expect = step["expect"]
        kwargs = resolve(step["args"], env)
        if "tf_crashed" in expect:
            try:
                op(**kwargs)
            except errors.GradserveError:
                pass
            assert client.raw_ops.StopGradient(input=np.float32(2.5)) == 2.5  # still serving
            return
        if "error" in expect:
            error_class = getattr(errors, expect["error"])
            with pytest.raises(error_class) as info:
                op(**kwargs)
            assert normalise(expect["message"]) in normalise(str(info.value))
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
