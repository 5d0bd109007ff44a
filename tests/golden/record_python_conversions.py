"""Record how ``tf.convert_to_tensor`` converts Python and NumPy values.

``client.raw_ops`` takes Python values as ``tf.raw_ops`` does: ``1.5`` is a float32,
``1`` an int32. ``tests/client/test_conversion.py`` holds the SDK's converter
(``gradserve.client._convert.to_array``) to this table. Each case is Python source,
evaluated with ``np`` and ``ml_dtypes`` in scope, so that the test rebuilds the very
same value (tuples, bytes, NumPy scalars, big ints); its ``expect`` is the tensor's
``{"dtype", "shape", "value"}`` or TensorFlow's ``{"error", "message"}`` (TensorFlow
raises ``ValueError`` for every refusal here).

``value`` is the tensor's nested list: floats that JSON lacks are "inf", "-inf", "nan";
a complex is ``[real, imag]``; a string (bytes) is a JSON string of one character per
byte (latin-1). Every case is also run through ``tf.raw_ops.Identity``, whose input
converts like a ``T``-typed raw-op argument such as TensorArrayWriteV3's ``value``:
``raw_ops_disagree`` lists the cases where it differs (none with TensorFlow 2.21).

TensorFlow is never a dependency of gradserve: install it by hand to re-record
(``make golden``). Re-running writes the same bytes.
"""

from __future__ import annotations

import json
import math
import pathlib

import ml_dtypes  # TensorFlow's own dependency
import numpy as np

OUT = pathlib.Path(__file__).parent / "python_conversions.json"
SCOPE = {"np": np, "ml_dtypes": ml_dtypes}  # what a case's source may name

CASES = [
    # Python scalars
    "True", "False", "0", "1", "-7", "2**31 - 1", "-2**31", "2**31", "-2**31 - 1",
    "2**63 - 1", "-2**63", "2**63", "-2**63 - 1", "2**64", "10**400",
    "1.5", "0.1", "-0.0", "float('inf')", "float('-inf')", "float('nan')", "5e-324",
    "1e-46", "3.4028234663852886e38", "3.4028235e38", "3.4028235677973366e38", "1e39",
    "1e300", "-1e300", "1j", "1.5 - 2j", "complex(1e300, -1e300)",
    "b'x'", "b''", "'x'", "''", "'\\u00e9'", "'\\u65e5\\u672c'", "'\\ud800'",
    "None", "Ellipsis", "{1: 2}", "{1, 2}",
    # flat and nested lists, tuples, ranges
    "[True, False]", "[1, 2, 3]", "[[1, 2], [3, 4]]", "(1, 2)", "((1.0,),)",
    "[(1, 2), (3, 4)]", "range(3)", "bytearray(b'ab')", "[1.5, -2.0]", "[[4.0, 5.0]]",
    "[0.1, 1e-46]", "[1j, 2j]", "[[1j], [2 + 0j]]", "[b'a', b'bc']", "['a', 'b']",
    "[b'a', 'b']", "[[b'a'], [b'b']]", "[b'', 'x']", "['\\u00e9']", "['\\ud800']",
    # ints that do not fit int32 or int64
    "[1, 2**31]", "[2**31 - 1, 2**31]", "[-2**31, 2**31 - 1]", "[2**62, 1]",
    "[1, 2**63]", "[2**63, 1]", "[[1], [2**40]]",
    # mixed Python types
    "[1, 2.0]", "[2.0, 1]", "[[1], [2.0]]", "[1, 1.0, 2**63]", "[1, 2**63, 1.0]",
    "[2**31, 1.0]", "[2**63, 1.0]", "[1.5, 2**40]", "[1.0, 10**39]", "[1.0, 10**400]",
    "[1.0, 1e39]", "[float('inf'), 1]", "[True, 1]", "[1, True]", "[True, 1.0]",
    "[1.0, True]", "[True, 2**40]", "[1, 1j]", "[1j, 1]", "[1.0, 1j]", "[1j, 1.0]",
    "[1j, True]", "[1j, 'a']", "['a', 1]", "[1, 'a']", "[1, 2**31, 'a']",
    "[1, 'a', 2**31]", "[b'a', bytearray(b'b')]", "[1, None]", "[None, 1]", "[None]",
    "[1, [2]]",
    # empty, ragged and odd nestings
    "[]", "()", "[[]]", "[[], []]", "[(), ()]", "[[[]]]", "[[], [1]]", "[[], 5]",
    "[[1], []]", "[[1, 2], [3]]", "[[1], [2, 3]]", "[[1], 2]", "[[1, 'a'], [2]]",
    "[[1], [2, 'a']]", "[['a', 'b'], 'cd']", "[[1, 2], {3, 4}]",
    # NumPy scalars
    "np.float64(1.5)", "np.float32(1.5)", "np.float16(1.5)", "np.float16(70000.0)",
    "np.int8(-3)", "np.int16(3)", "np.int32(3)", "np.int64(3)", "np.int64(2**40)",
    "np.uint8(3)", "np.uint16(3)", "np.uint32(3)", "np.uint64(2**64 - 1)", "np.bool_(True)",
    "np.complex64(1 + 2j)", "np.complex128(1 + 2j)", "np.str_('s')", "np.bytes_(b'ab')",
    "np.longdouble(1)", "np.clongdouble(1)", "np.datetime64(1, 'D')", "np.timedelta64(1)",
    # NumPy scalars and arrays inside lists: the first leaf decides
    "[np.float64(1.0), 2]", "[np.float32(1.0), np.float64(2.0)]",
    "[np.float64(1.0), np.float32(2.0)]", "[np.float16(1.0), 2.0]",
    "[np.float16(1.0), 70000.0]", "[np.float16(1.0), 70000]", "[np.int64(1), 2]",
    "[np.int8(1), np.int8(2)]", "[np.int8(1), 1.5]", "[1, np.float16(1.5)]",
    "[np.int64(2**40)]", "[np.uint64(2**64 - 1)]", "[np.longdouble(1)]",
    "[np.complex64(1)]", "[np.complex128(1), 2]", "[True, np.bool_(False)]",
    "[np.bool_(True), False]", "[1.5, np.bool_(True)]", "[np.array(1.5), 2]",
    "[np.array(2), 1.5]", "[[np.array(1)]]", "[np.array([1.0]), [2.0]]",
    "[np.array([1, 2], np.int8)]", "[np.array(['a'])]", "[np.array([1.0]), np.array([1.0, 2.0])]",
    # NumPy arrays keep their dtype
    "np.array(1.5)", "np.array(1, np.int16)", "np.array(True)", "np.array('a')",
    "np.array(b'a')", "np.array([1.0, 2.0])", "np.array([[1, 2], [3, 4]])",
    "np.array([[1, 2], [3, 4]], np.uint16)", "np.array([1, 2], np.int8)",
    "np.array([1 + 2j], np.complex64)", "np.array([True, False])",
    "np.arange(6, dtype=np.float32).reshape(2, 3)", "np.zeros((0, 3))",
    "np.zeros((2, 0), np.int32)", "np.array([1.0], '>f4')", "np.array([1], '>i8')",
    "np.arange(4.0).reshape(2, 2)[:, ::2]", "np.array(['a', 'bc'])", "np.array(['\\u00e9'])",
    "np.array([b'a', b'bc'])", "np.array([b'a\\x00'])", "np.array([b'a', 'b'], dtype=object)",
    "np.array([], dtype=object)", "np.array([None], dtype=object)",
    "np.array([1, 'a'], dtype=object)", "np.array(['\\ud800'])",
    "np.zeros(2, dtype=[('a', 'i4')])", "np.zeros(2, 'V2')",
    "np.array(['2020-01-01'], 'datetime64[D]')", "np.array([1.0], np.longdouble)",
    # bfloat16 (ml_dtypes, TensorFlow's NumPy type for it)
    "ml_dtypes.bfloat16(1.5)", "np.array([1.5, -2.0], ml_dtypes.bfloat16)",
    "[ml_dtypes.bfloat16(1.5)]",
]  # fmt: skip


def encode(x):
    """One element of a tensor's nested list, as JSON holds it."""
    if isinstance(x, list):
        return [encode(v) for v in x]
    if isinstance(x, bool | int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, complex):
        return [encode(x.real), encode(x.imag)]
    if isinstance(x, bytes):
        return x.decode("latin-1")
    raise TypeError(f"cannot encode {x!r}")


def convert(f, value):
    """What TensorFlow makes of ``value``: the tensor's description or the error."""
    try:
        t = f(value)
    except Exception as e:  # noqa: BLE001 -- the refusal is what is recorded
        return {"error": type(e).__name__, "message": str(e)}
    a = np.asarray(t.numpy())  # a string scalar's numpy() is bytes
    return {"dtype": t.dtype.name, "shape": list(a.shape), "value": encode(a.tolist())}


def main() -> None:
    import tensorflow as tf

    assert len(set(CASES)) == len(CASES), "duplicate case"
    cases, disagree = [], []
    for source in CASES:
        with np.errstate(over="ignore"):  # np.float16(70000.0) warns as it is built
            value, again = eval(source, SCOPE), eval(source, SCOPE)  # {1, 2}: fresh each
        expect = convert(tf.convert_to_tensor, value)
        raw = convert(lambda v: tf.raw_ops.Identity(input=v), again)
        if raw != expect:
            disagree.append({"value": source, "raw_ops": raw})
        cases.append({"value": source, "expect": expect})
    meta = {
        "recorded_with": f"tensorflow {tf.__version__}, numpy {np.__version__}",
        "raw_ops_disagree": disagree,
        "cases": cases,
    }
    OUT.write_text(json.dumps(meta, indent=1, ensure_ascii=True) + "\n")
    print(f"{len(cases)} conversions written to {OUT} ({len(disagree)} differ in raw_ops)")


if __name__ == "__main__":
    main()
