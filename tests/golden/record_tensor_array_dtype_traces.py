"""Record bfloat16 and string TensorArray traces from TensorFlow into
``tensor_array_traces_dtypes.json``, and traces of the zero-element Gather and Concat.

Same format and the same worker as ``record_tensor_array_traces.py`` (whose random trace
maker this reuses), so ``test_golden_traces`` replays them with the others:

* ``CURATED``: hand-made traces, named ``<dtype>_<what>`` (``zero_gather_*`` and
  ``zero_concat_*`` for the early-return cases): every op on bfloat16 and string arrays,
  grad-array sums (bfloat16 sums round each float32 sum to bfloat16, ties to even;
  strings refuse to sum), the zeros of unwritten elements, dtype mismatches; and
  TensorArrayGatherV3 / TensorArrayConcatV3 over elements with no values.
* ``RANDOM`` seeded random traces per dtype (``<dtype>_random_NNN``), values drawn from a
  small pool (for bfloat16, values whose sums round).

Values in the format: see ``trace_format`` (bfloat16 as floats, strings as latin-1 text).
TensorFlow is never a dependency: install it by hand (with ml_dtypes, which it brings) to
re-record, e.g.

    /tmp/tf/bin/python tests/golden/record_tensor_array_dtype_traces.py
"""

from __future__ import annotations

import pathlib
import sys

import ml_dtypes
import numpy as np
from record_tensor_array_traces import _TraceMaker
from tf_record import record_to, worker
from trace_format import tensor

OUT = pathlib.Path(__file__).parent / "tensor_array_traces_dtypes.json"
SEED = 2027
RANDOM = {"bfloat16": 40, "string": 40}

BF16 = ml_dtypes.bfloat16
#: bfloat16 values the random traces write: sums of them round (1 + 2**-8 is 1, a tie
#: to even; 256 + 1 is 256; 256 + 3 is 260; 2**-8 + 2**-8 + 1 is 1.0078125 but
#: (1 + 2**-8) + 2**-8 is 1), and -0.0 (-0.0 + -0.0 is -0.0, -0.0 + 0.0 is 0.0).
BF16_POOL = np.array([1, 2**-8, 1 + 2**-7, 256, 3, -1, 0.5, -0.0, 2**-9, 100], BF16)
#: Strings the random traces write: empty, ASCII, NUL, non-UTF-8 and UTF-8 bytes.
STRING_POOL = np.array([b"", b"a", b"bc", b"\x00", b"\xff\xfe", "é".encode(), b"x y"], object)
#: The dtype of the random traces' mismatched values and reads.
OTHER = {"bfloat16": "float32", "string": "int64"}


class _DTypeTraceMaker(_TraceMaker):
    """A random trace over an array of one given dtype, values from its pool."""

    def __init__(self, rng: np.random.Generator, dtype: str) -> None:
        super().__init__(rng, dtype)
        self.pool = BF16_POOL if dtype == "bfloat16" else STRING_POOL

    def value(self, rows: tuple = (), shape: tuple | None = None) -> np.ndarray:
        shape = self.value_shape if shape is None else shape
        if self.odd():
            shape = [(3,), (), (2, 2), (0,)][self.rng.integers(4)]
        size = rows + tuple(shape)
        if self.odd():
            return self.rng.integers(-5, 6, size=size).astype(OTHER[self.dtype])
        return self.pool[self.rng.integers(len(self.pool), size=size)]

    def read_dtype(self) -> str:
        return OTHER[self.dtype] if self.odd() else self.dtype


# ---------------------------------------------------------------- step builders
def create(size: int, element_shape, dtype: str, **flags) -> dict:
    args = {"size": size, "dtype": dtype, "element_shape": element_shape,
            "dynamic_size": False, "clear_after_read": True,
            "identical_element_shapes": False, "tensor_array_name": "ta"} | flags  # fmt: skip
    return {"op": "TensorArrayV3", "args": args, "out": ["ta", "f"]}


def write(index: int, value: np.ndarray, h: str = "ta") -> dict:
    f = _flow(h)
    args = {"handle": f"${h}", "index": index, "value": tensor(value), "flow_in": f"${f}"}
    return {"op": "TensorArrayWriteV3", "args": args, "out": [f]}


def read(index: int, dtype: str, h: str = "ta") -> dict:
    args = {"handle": f"${h}", "index": index, "flow_in": f"${_flow(h)}", "dtype": dtype}
    return {"op": "TensorArrayReadV3", "args": args}


def gather(indices: list[int], dtype: str, element_shape=None, h: str = "ta") -> dict:
    args = {"handle": f"${h}", "indices": tensor(np.array(indices, np.int32)),
            "flow_in": f"${_flow(h)}", "dtype": dtype, "element_shape": element_shape}  # fmt: skip
    return {"op": "TensorArrayGatherV3", "args": args}


def scatter(indices: list[int], value: np.ndarray, h: str = "ta") -> dict:
    f = _flow(h)
    args = {"handle": f"${h}", "indices": tensor(np.array(indices, np.int32)),
            "value": tensor(value), "flow_in": f"${f}"}  # fmt: skip
    return {"op": "TensorArrayScatterV3", "args": args, "out": [f]}


def concat(dtype: str, except0=None, h: str = "ta") -> dict:
    args = {"handle": f"${h}", "flow_in": f"${_flow(h)}", "dtype": dtype,
            "element_shape_except0": except0}  # fmt: skip
    return {"op": "TensorArrayConcatV3", "args": args}


def split(value: np.ndarray, lengths: list[int], h: str = "ta") -> dict:
    f = _flow(h)
    args = {"handle": f"${h}", "value": tensor(value),
            "lengths": tensor(np.array(lengths, np.int64)), "flow_in": f"${f}"}  # fmt: skip
    return {"op": "TensorArraySplitV3", "args": args, "out": [f]}


def size(h: str = "ta") -> dict:
    return {"op": "TensorArraySizeV3", "args": {"handle": f"${h}", "flow_in": f"${_flow(h)}"}}


def close(h: str = "ta") -> dict:
    return {"op": "TensorArrayCloseV3", "args": {"handle": f"${h}"}}


def grad(out: str, source: str = "s", prepend: list[int] | None = None) -> dict:
    """A grad array of the forward ``ta``: handle ``$out``, flow ``$<out>f``."""
    args = {"handle": "$ta", "flow_in": "$f", "source": source}
    if prepend is None:
        return {"op": "TensorArrayGradV3", "args": args, "out": [out, out + "f"]}
    args["shape_to_prepend"] = tensor(np.array(prepend, np.int32))
    return {"op": "TensorArrayGradWithShape", "args": args, "out": [out, out + "f"]}


def _flow(h: str) -> str:
    return "f" if h == "ta" else h + "f"


def bf(*values) -> np.ndarray:
    return np.array(values, BF16)


def strs(*values) -> np.ndarray:
    out = np.empty(len(values), object)
    out[:] = [v.encode() if isinstance(v, str) else v for v in values]
    return out


def _bfloat16() -> dict[str, list[dict]]:
    t = "bfloat16"
    big = float(ml_dtypes.finfo(BF16).max)  # (2 - 2**-7) * 2**127
    keep = {"clear_after_read": False}
    return {
        # Every op: exact values (tiny, huge, -0.0, a subnormal) through each.
        "bfloat16_every_op": [
            create(3, None, t, **keep),
            write(0, bf(1, 2**-8, 1 + 2**-7)),
            scatter([2, 1], np.array([[-0.0, 3.0e38, 9.2e-41], [0.1, -2.5, 1e10]], BF16)),
            read(0, t),
            read(2, t),
            gather([2, 0, 1, 0], t, [3]),
            size(),
            concat(t),
            close(),
            read(1, t),
        ],
        "bfloat16_split_concat": [
            create(3, None, t, **keep),
            split(np.arange(-2, 3, dtype=np.float32).astype(BF16) / 3, [2, 0, 3]),
            read(1, t),
            read(2, t),
            concat(t, []),
            gather([0, 2], t),
        ],
        "bfloat16_split_2d": [
            create(2, [None, 2], t, **keep),
            split(np.arange(6, dtype=BF16).reshape(3, 2) + BF16(0.5), [1, 2]),
            concat(t, [2]),
            gather([1], t),
        ],
        # Repeated writes to a grad array sum, each sum rounded to bfloat16 (ties to
        # even): 1 + 2**-8 is 1, 256 + 1 is 256, 256 + 3 is 260, (1 + 2**-7) + 2**-8 is
        # 1 + 2**-6, -0.0 + -0.0 is -0.0; the order of the writes matters.
        "bfloat16_grad_sums_round": [
            create(3, [5], t),
            write(0, bf(1, 1, 1, 1, 1)),
            grad("g"),
            write(0, bf(1, 256, 256, 1 + 2**-7, -0.0), "g"),
            write(0, bf(2**-8, 1, 3, 2**-8, -0.0), "g"),
            read(0, t, "g"),
            grad("h", "other"),
            write(1, bf(2**-8, 2**-8, 1, -0.0, 0.0), "h"),
            write(1, bf(2**-8, 1, 2**-8, 0.0, -0.0), "h"),
            write(1, bf(1, 2**-8, 2**-8, -0.0, -0.0), "h"),
            read(1, t, "h"),
            read(2, t, "h"),  # never written: zeros of the element shape
        ],
        # The largest bfloat16 plus half its last place: a tie, rounded to even, is inf.
        "bfloat16_grad_sum_overflows": [
            create(1, [3], t),
            grad("g"),
            write(0, bf(big, -big, big), "g"),
            write(0, bf(2.0**119, -(2.0**119), 2.0**118), "g"),
            read(0, t, "g"),
        ],
        # A grad array's soft copies of the forward's written shapes read as zeros.
        "bfloat16_grad_soft_copy_zeros": [
            create(2, None, t),
            write(0, bf(5, 6)),
            grad("g"),
            read(0, t, "g"),
            grad("p", "p", [2]),
            write(1, np.full((2, 2), 1.5, BF16), "p"),
            gather([1, 0], t, None, "p"),
        ],
        "bfloat16_unwritten_zeros": [
            create(3, [2], t, **keep),
            write(1, bf(-1, 7)),
            read(0, t),
            gather([2, 1, 0], t),
            concat(t, []),
        ],
        "bfloat16_size_zero": [
            create(0, [2], t),
            gather([], t, [2]),
            concat(t, []),
            size(),
        ],
        # The dtype is checked exactly: float32 (or float16) is not bfloat16.
        "bfloat16_write_float32": [create(2, None, t), write(0, np.ones(2, np.float32))],
        "bfloat16_write_float16": [create(2, None, t), write(0, np.ones(2, np.float16))],
        "bfloat16_read_as_float32": [create(2, [2], t), write(0, bf(1, 2)), read(0, "float32")],
        "bfloat16_gather_as_float16": [create(2, [2], t), gather([0], "float16")],
        "bfloat16_concat_as_float32": [create(2, [2], t), concat("float32")],
        "bfloat16_scatter_float32": [create(2, None, t), scatter([0], np.ones((1, 2), np.float32))],
        "bfloat16_split_float32": [create(2, None, t), split(np.ones(2, np.float32), [1, 1])],
        "bfloat16_grad_write_float32": [
            create(2, None, t),
            write(0, bf(1, 2)),
            grad("g"),
            write(0, np.ones(2, np.float32), "g"),
        ],
        "float32_write_bfloat16": [create(2, None, "float32"), write(0, bf(1, 2))],
        "float32_read_as_bfloat16": [
            create(2, [2], "float32"),
            write(0, np.ones(2, np.float32)),
            read(0, t),
        ],
        # The grad's sum needs the same shape.
        "bfloat16_grad_sum_shape_mismatch": [
            create(2, None, t),
            grad("g"),
            write(0, bf(1, 2), "g"),
            write(0, bf(1, 2, 3), "g"),
        ],
    }


def _string() -> dict[str, list[dict]]:
    t = "string"
    keep = {"clear_after_read": False}
    return {
        "string_every_op": [
            create(3, None, t, **keep),
            write(0, strs("", "a", b"\x00\xff")),
            scatter([2, 1], np.array([["é", "x y", "z"], [b"\xfe", "", "long " * 20]], object)),
            read(0, t),
            read(1, t),
            gather([2, 0, 1, 0], t, [3]),
            size(),
            concat(t),
            close(),
            read(1, t),
        ],
        "string_split_concat": [
            create(3, None, t, **keep),
            split(strs("a", "", "bc", b"\x00", "é"), [2, 0, 3]),
            read(1, t),
            read(2, t),
            concat(t, []),
            gather([0, 2], t),
        ],
        "string_split_2d": [
            create(2, [None, 2], t, **keep),
            split(np.array([["a", "b"], ["c", ""], ["", "d"]], object), [1, 2]),
            concat(t, [2]),
            gather([1], t),
        ],
        "string_scalars": [
            create(2, [], t, **keep),
            write(0, np.array(b"only", object)),
            write(1, np.array(b"", object)),
            gather([1, 0], t),
            concat(t),
        ],
        # A grad array takes one write of strings per index (it replaces the soft copy
        # of zeros), and reads it; a second write would sum: refused.
        "string_grad_write_once": [
            create(2, [2], t),
            write(0, strs("x", "y")),
            grad("g"),
            write(0, strs("p", "q"), "g"),
            write(1, strs("r", ""), "g"),
            read(0, t, "g"),
            gather([1], t, None, "g"),
        ],
        "string_grad_sum_refused": [
            create(2, None, t),
            write(0, strs("x", "y")),
            grad("g"),
            write(0, strs("p", "q"), "g"),
            write(0, strs("p", "q"), "g"),
        ],
        # Unwritten at the forward too: the first write stores, the second sums.
        "string_grad_sum_refused_unwritten": [
            create(2, None, t),
            grad("g"),
            write(1, strs("p"), "g"),
            write(1, strs("p"), "g"),
        ],
        # Elements with no strings never sum: any number of writes.
        "string_grad_empty_elements": [
            create(2, None, t),
            write(0, strs()),
            grad("g"),
            write(0, strs(), "g"),
            write(0, strs(), "g"),
            read(0, t, "g"),
        ],
        # An unwritten element of a known shape: TensorFlow has no zeros of strings
        # (tensor_array::TensorSetZero), unless the shape holds no element.
        "string_read_unwritten": [create(2, [2], t), write(0, strs("a", "b")), read(1, t)],
        "string_read_unwritten_scalar": [create(2, [], t), read(0, t)],
        "string_read_unwritten_empty": [
            create(2, [0], t, **keep),
            read(1, t),
            gather([0, 1], t),
            concat(t),
        ],
        "string_gather_unwritten": [
            create(2, [2], t),
            write(0, strs("a", "b")),
            gather([0, 1], t),
        ],
        "string_concat_unwritten": [create(2, [2], t), write(0, strs("a", "b")), concat(t)],
        "string_grad_read_soft_copy": [
            create(2, None, t),
            write(0, strs("x", "y")),
            grad("g"),
            read(0, t, "g"),
        ],
        "string_grad_concat_unwritten": [
            create(2, [2], t),
            write(0, strs("x", "y")),
            grad("g"),
            write(0, strs("p", "q"), "g"),
            concat(t, None, "g"),
        ],
        "string_size_zero": [create(0, [2], t), gather([], t, [2]), concat(t, [2]), size()],
        "string_write_int32": [create(2, None, t), write(0, np.ones(2, np.int32))],
        "string_write_float32_scalar": [create(2, None, t), write(0, np.float32(1))],
        "string_read_as_int64": [create(2, [1], t), write(0, strs("a")), read(0, "int64")],
        "string_gather_as_float32": [create(2, [1], t), gather([0], "float32")],
        "string_concat_as_bfloat16": [create(2, [1], t), concat("bfloat16")],
        "string_scatter_int64": [create(2, None, t), scatter([1], np.ones((1, 1), np.int64))],
        "string_split_float32": [create(2, None, t), split(np.ones(2, np.float32), [1, 1])],
        "int32_write_string": [create(2, None, "int32"), write(0, strs("1", "2"))],
        "float32_scatter_string": [
            create(2, None, "float32"),
            scatter([0], np.array([["a"]], object)),
        ],
        "bool_read_as_string": [
            create(2, [1], "bool"),
            write(0, np.array([True])),
            read(0, t),
        ],
        # The write is checked before the element shape is compared.
        "string_write_wrong_shape": [create(2, [2], t), write(0, strs("a", "b", "c"))],
    }


def _zero_element_gather() -> dict[str, list[dict]]:
    """TensorArrayGatherV3 allocates [n, *element 0's shape] after reading every index;
    when that holds no element it returns it without comparing the other shapes."""
    f32, keep = "float32", {"clear_after_read": False}

    def ta(*shapes, dtype: str = f32, **flags) -> list[dict]:
        steps = [create(len(shapes), None, dtype, **(keep | flags))]
        for i, shape in enumerate(shapes):
            if shape is not None:
                steps.append(write(i, ones(shape, dtype)))
        return steps

    return {
        # Element 0 [0, 3], element 3 [3, 3]: [2, 0, 3]; in the other order a mismatch.
        "zero_gather_first_empty": [
            *ta((0, 3), None, None, (3, 3)),
            gather([0, 3], f32),
            gather([0, 3, 3, 0], f32, [0, 3]),
            gather([3, 0], f32),
        ],
        "zero_gather_other_rank": [
            *ta((3, 0), (2,), ()),
            gather([0, 1, 2], f32),
            gather([0, 0], f32, [3, 0]),
            gather([1, 0], f32),
        ],
        "zero_gather_scalar_later": [*ta((0,), ()), gather([0, 1], f32), gather([1, 0], f32)],
        # The element_shape argument is compared with element 0 first.
        "zero_gather_element_shape_mismatch": [
            *ta((0, 3), (3, 3)),
            gather([0, 1], f32, [1, 3]),
        ],
        "zero_gather_element_shape_partial": [
            *ta((0, 3), (3, 3)),
            gather([0, 1], f32, [None, 3]),
            gather([0, 1], f32, [None, 4]),
        ],
        # Every index is read first: clear_after_read clears them all.
        "zero_gather_clears_reads": [
            *ta((0, 3), (3, 3), clear_after_read=True),
            gather([0, 1], f32),
            read(1, f32),
        ],
        # An unreadable later index still fails (the reads come first).
        "zero_gather_later_unwritten": [*ta((0, 3), None), gather([0, 1], f32)],
        "zero_gather_later_out_of_range": [*ta((0, 3), (3, 3)), gather([0, 2], f32)],
        # The array's element shape is merged with the argument first.
        "zero_gather_known_element_shape": [
            create(2, [None, 3], f32, **keep),
            write(0, np.ones((0, 3), np.float32)),
            write(1, np.ones((2, 3), np.float32)),
            gather([0, 1], f32),
            gather([1, 0], f32),
        ],
        # A grad array's unwritten elements (zeros of the soft copy's shape) count too.
        "zero_gather_grad_soft_copy": [
            create(2, None, f32),
            write(0, np.ones((0, 2), np.float32)),
            write(1, np.ones((2, 2), np.float32)),
            grad("g"),
            gather([0, 1], f32, None, "g"),
        ],
        "zero_gather_bfloat16": [
            *ta((0, 2), (2,), dtype="bfloat16"),
            gather([0, 1], "bfloat16"),
            gather([1, 0], "bfloat16"),
        ],
        "zero_gather_string": [
            *ta((2, 0), (1, 1), dtype="string"),
            gather([0, 1], "string"),
            gather([1, 0], "string"),
        ],
    }


def _zero_element_concat() -> dict[str, list[dict]]:
    """TensorArrayConcatV3 compares every element's shape (past dim 0) before it
    allocates: no early return, whatever the elements hold."""
    f32, keep = "float32", {"clear_after_read": False}

    def ta(*shapes, dtype: str = f32) -> list[dict]:
        steps = [create(len(shapes), None, dtype, **keep)]
        for i, shape in enumerate(shapes):
            steps.append(write(i, ones(shape, dtype)))
        return steps

    return {
        "zero_concat_except0_mismatch": [*ta((0, 3), (0, 4)), concat(f32)],
        "zero_concat_except0_mismatch_later": [*ta((0, 3), (2, 4)), concat(f32)],
        "zero_concat_rank_mismatch": [*ta((2, 0), (1, 1)), concat(f32)],
        "zero_concat_rank_mismatch_empty": [*ta((0,), (0, 0)), concat(f32)],
        "zero_concat_scalar_later": [*ta((0,), ()), concat(f32)],
        "zero_concat_scalar_first": [*ta((), (0,)), concat(f32)],
        "zero_concat_empty_rows": [*ta((2, 0), (3, 0), (0, 0)), concat(f32), concat(f32, [0])],
        "zero_concat_empty_then_full": [*ta((0, 3), (2, 3)), concat(f32), concat(f32, [3])],
        "zero_concat_element_shape_mismatch": [*ta((0, 3), (0, 3)), concat(f32, [4])],
        "zero_concat_bfloat16": [*ta((0, 2), (0, 3), dtype="bfloat16"), concat("bfloat16")],
        "zero_concat_string": [*ta((0, 2), (1, 2), dtype="string"), concat("string")],
    }


def ones(shape: tuple, dtype: str) -> np.ndarray:
    """Ones of ``shape`` (for strings, b"1" each)."""
    if dtype == "string":
        out = np.empty(shape, object)
        out.fill(b"1")
        return out
    return np.ones(shape, BF16 if dtype == "bfloat16" else dtype)


#: Hand-made traces (see the module docstring).
CURATED = _bfloat16() | _string() | _zero_element_gather() | _zero_element_concat()


def make_traces(seed: int) -> dict[str, list[dict]]:
    rng = np.random.default_rng(seed)
    traces = dict(CURATED)
    for dtype, count in RANDOM.items():
        for k in range(count):
            traces[f"{dtype}_random_{k:03d}"] = _DTypeTraceMaker(rng, dtype).steps()
    return traces


def main() -> None:
    record_to(OUT, SEED, make_traces(SEED))


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else main()
