"""Record random TensorArray traces from TensorFlow into ``tensor_array_traces_random.json``.

The shared ``tensor_array_traces.json`` holds 21 hand-written traces. This script adds
a few of its own (``CURATED``) and a few hundred random ones (seeded, so a re-recording
reproduces them): op sequences
over a forward array and its grad arrays that are mostly valid, with an occasional
wrong index, dtype or shape, in the same format, so that ``test_golden_traces``
replays them all. TensorFlow is never a dependency of gradserve: install it by hand to
re-record, e.g.

    python3 -m venv /tmp/tf && /tmp/tf/bin/pip install "tensorflow-cpu==2.21.*" numpy
    /tmp/tf/bin/python tests/golden/record_tensor_array_traces.py

TensorFlow 2.21 kills its own process (SIGSEGV) on some sequences, e.g. a Concat of a
grad array with unwritten elements: ``tf_record`` runs the traces in a worker process
and ends a trace that killed it with that step, marked ``{"tf_crashed": true}``.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
from tf_record import record_to, worker
from trace_format import tensor

OUT = pathlib.Path(__file__).parent / "tensor_array_traces_random.json"
SEED = 2026
TRACES = 400
DTYPES = ["float32", "float32", "int32", "float64"]
ELEMENT_SHAPES = [None, [2], [None], [2, None], [], [0], [1, 2]]


class _TraceMaker:
    """One random trace: a forward array, then ops on it and on its grad arrays."""

    def __init__(self, rng: np.random.Generator, dtype: str | None = None) -> None:
        self.rng = rng
        # ``dtype`` given (``record_tensor_array_dtype_traces``): no draw for it.
        self.dtype = str(rng.choice(DTYPES)) if dtype is None else dtype
        self.size = int(rng.integers(0, 4))
        self.element_shape = ELEMENT_SHAPES[rng.integers(len(ELEMENT_SHAPES))]
        # The element shape most writes use: the declared one, unknown dims as 3.
        declared = self.element_shape
        self.value_shape = (
            (2,) if declared is None else tuple(3 if d is None else d for d in declared)
        )
        self.arrays = [("ta", "f")]
        self.grads = 0
        # A rough model, so that most steps are valid and traces get long: the
        # forward's written indices (a second write fails there; grads sum).
        self.written: set[int] = set()

    def odd(self, p: float = 0.04) -> bool:
        return bool(self.rng.random() < p)

    def value(self, rows: tuple = (), shape: tuple | None = None) -> np.ndarray:
        shape = self.value_shape if shape is None else shape
        if self.odd():
            shape = [(3,), (), (2, 2), (0,)][self.rng.integers(4)]
        dtype = "int64" if self.odd() else self.dtype
        return self.rng.integers(-5, 6, size=rows + tuple(shape)).astype(dtype)

    def index(self, handle: str = "", fresh: bool = False) -> int:
        """An index in range; for a write to the forward, one not written yet."""
        if self.odd():
            return int(self.rng.choice([-1, self.size, self.size + 2]))
        choices = range(max(self.size, 1))
        if fresh and handle == "ta":
            choices = [i for i in choices if i not in self.written] or [self.size]
        index = int(self.rng.choice(list(choices)))
        if fresh and handle == "ta":
            self.written.add(index)
        return index

    def shape_arg(self, base) -> list | None:
        if self.odd(0.1):
            return [[3], [None], None, [1, 2]][self.rng.integers(4)]
        return None if base is None else list(base)

    def steps(self) -> list[dict]:
        rng = self.rng
        steps = [{
            "op": "TensorArrayV3",
            "args": {
                "size": self.size, "dtype": self.dtype, "element_shape": self.element_shape,
                "dynamic_size": bool(rng.integers(2)), "clear_after_read": bool(rng.integers(2)),
                "identical_element_shapes": bool(rng.integers(2)), "tensor_array_name": "ta",
            },
            "out": ["ta", "f"],
        }]  # fmt: skip
        ops = [self.write, self.read, self.gather, self.scatter, self.concat, self.split,
               self.size_op, self.grad, self.close]  # fmt: skip
        weights = np.array([30, 18, 10, 6, 6, 3, 5, 12, 2], float)
        for _ in range(int(rng.integers(2, 16))):
            handle, flow = self.arrays[rng.integers(len(self.arrays))]
            steps.append(ops[rng.choice(len(ops), p=weights / weights.sum())](handle, flow))
        return steps

    def read_dtype(self) -> str:
        return "int64" if self.odd() else self.dtype

    def write(self, h: str, f: str) -> dict:
        args = {"handle": f"${h}", "index": self.index(h, fresh=True),
                "value": tensor(self.value()), "flow_in": f"${f}"}  # fmt: skip
        return {"op": "TensorArrayWriteV3", "args": args, "out": [f]}

    def read(self, h: str, f: str) -> dict:
        args = {"handle": f"${h}", "index": self.index(), "flow_in": f"${f}",
                "dtype": self.read_dtype()}  # fmt: skip
        return {"op": "TensorArrayReadV3", "args": args}

    def gather(self, h: str, f: str) -> dict:
        indices = np.array([self.index() for _ in range(self.rng.integers(0, 4))], np.int32)
        args = {"handle": f"${h}", "indices": tensor(indices), "flow_in": f"${f}",
                "dtype": self.read_dtype(), "element_shape": self.shape_arg(self.value_shape)}  # fmt: skip
        return {"op": "TensorArrayGatherV3", "args": args}

    def scatter(self, h: str, f: str) -> dict:
        count = self.rng.integers(0, 4)
        indices = np.array([self.index(h, fresh=True) for _ in range(count)], np.int32)
        rows = len(indices) + (1 if self.odd() else 0)
        args = {"handle": f"${h}", "indices": tensor(indices),
                "value": tensor(self.value((rows,))), "flow_in": f"${f}"}  # fmt: skip
        return {"op": "TensorArrayScatterV3", "args": args, "out": [f]}

    def concat(self, h: str, f: str) -> dict:
        args = {"handle": f"${h}", "flow_in": f"${f}", "dtype": self.read_dtype(),
                "element_shape_except0": self.shape_arg(self.value_shape[1:])}  # fmt: skip
        return {"op": "TensorArrayConcatV3", "args": args}

    def split(self, h: str, f: str) -> dict:
        n = self.size if not self.odd(0.1) else int(self.rng.integers(0, 4))
        if h == "ta":
            self.written.update(range(n))
        lengths = self.rng.integers(0, 3, size=n).astype(np.int64)
        rows = int(lengths.sum()) + (1 if self.odd() else 0)
        # Each element is a block of rows: value_shape with its first dim replaced.
        value = self.value((rows,), self.value_shape[1:])
        args = {"handle": f"${h}", "value": tensor(value), "lengths": tensor(lengths),
                "flow_in": f"${f}"}  # fmt: skip
        return {"op": "TensorArraySplitV3", "args": args, "out": [f]}

    def size_op(self, h: str, f: str) -> dict:
        return {"op": "TensorArraySizeV3", "args": {"handle": f"${h}", "flow_in": f"${f}"}}

    def close(self, h: str, f: str) -> dict:
        return {"op": "TensorArrayCloseV3", "args": {"handle": f"${h}"}}

    def grad(self, h: str, f: str) -> dict:
        grad = f"g{self.grads}"
        self.grads += 1
        self.arrays.append((grad, grad + "f"))
        source = ["gradients", "other"][self.rng.integers(2)]
        args = {"handle": "$ta", "flow_in": "$f", "source": source}
        if self.odd(0.2):
            prepend = np.array([[], [1], [2, 1]][self.rng.integers(3)], np.int32)
            args["shape_to_prepend"] = tensor(prepend)
            return {"op": "TensorArrayGradWithShape", "args": args, "out": [grad, grad + "f"]}
        return {"op": "TensorArrayGradV3", "args": args, "out": [grad, grad + "f"]}


def _create(size: int, element_shape, dtype: str = "float32") -> dict:
    args = {"size": size, "dtype": dtype, "element_shape": element_shape,
            "dynamic_size": False, "clear_after_read": True,
            "identical_element_shapes": False, "tensor_array_name": "ta"}  # fmt: skip
    return {"op": "TensorArrayV3", "args": args, "out": ["ta", "f"]}


#: Hand-made traces for differences the random ones found (ours once differed there).
CURATED = {
    # Split checks the size against len(lengths) before the dtype.
    "split_size_checked_before_dtype": [
        _create(2, None),
        {"op": "TensorArraySplitV3", "args": {
            "handle": "$ta", "value": tensor(np.arange(3, dtype=np.int64)),
            "lengths": tensor(np.array([3], np.int64)), "flow_in": "$f"}},
    ],
    # A gather of no indices reads nothing: a closed array answers it.
    "gather_nothing_from_closed": [
        _create(0, [2]),
        {"op": "TensorArrayCloseV3", "args": {"handle": "$ta"}},
        {"op": "TensorArrayGatherV3", "args": {
            "handle": "$ta", "indices": tensor(np.zeros(0, np.int32)), "flow_in": "$f",
            "dtype": "float32", "element_shape": [2]}},
        {"op": "TensorArrayGatherV3", "args": {
            "handle": "$ta", "indices": tensor(np.zeros(0, np.int32)), "flow_in": "$f",
            "dtype": "float32", "element_shape": None}},
    ],
}  # fmt: skip


def _grad_sum(dtype: str) -> list[dict]:
    """Two writes to one index of a grad array, then reads of it and of an unwritten one."""
    values = [np.array([1, 0, 2]) + k for k in range(3)]
    values = [(v % 2 == 0) if dtype == "bool" else v.astype(dtype) for v in values]

    def write(handle: str, value: np.ndarray) -> dict:
        args = {"handle": f"${handle}", "index": 0, "value": tensor(value),
                "flow_in": f"${handle}f"}  # fmt: skip
        return {"op": "TensorArrayWriteV3", "args": args, "out": [f"{handle}f"]}

    def read(index: int) -> dict:
        args = {"handle": "$g", "index": index, "flow_in": "$gf", "dtype": dtype}
        return {"op": "TensorArrayReadV3", "args": args}

    create = _create(2, None, dtype)
    create["out"] = ["ta", "taf"]
    grad = {"op": "TensorArrayGradV3", "args": {"handle": "$ta", "flow_in": "$taf",
            "source": "s"}, "out": ["g", "gf"]}  # fmt: skip
    return [create, write("ta", values[0]), grad, write("g", values[1]), write("g", values[2]),
            read(0), read(1)]  # fmt: skip


def _grad_cases() -> dict[str, list[dict]]:
    """Grad of a grad array, and TensorArrayGradWithShape with good and bad shapes."""
    create = _create(2, [2])
    write = {"op": "TensorArrayWriteV3", "args": {"handle": "$ta", "index": 0,
             "value": tensor(np.ones(2, np.float32)), "flow_in": "$f"}, "out": ["f"]}  # fmt: skip

    def grad(handle: str, out: str, source: str = "s", prepend=None) -> dict:
        args = {"handle": f"${handle}", "flow_in": f"${handle}f" if handle != "ta" else "$f",
                "source": source}  # fmt: skip
        if prepend is None:
            return {"op": "TensorArrayGradV3", "args": args, "out": [out, out + "f"]}
        args["shape_to_prepend"] = tensor(np.array(prepend, np.int32))
        return {"op": "TensorArrayGradWithShape", "args": args, "out": [out, out + "f"]}

    def read(handle: str, index: int) -> dict:
        args = {"handle": f"${handle}", "index": index, "flow_in": f"${handle}f",
                "dtype": "float32"}  # fmt: skip
        return {"op": "TensorArrayReadV3", "args": args}

    return {
        "grad_of_a_grad_array": [create, write, grad("ta", "g"), grad("g", "gg")],
        # The same source again returns the first array: its prepended shape stays.
        "grad_with_shape": [
            create,
            write,
            grad("ta", "p", "p", [3]),
            read("p", 0),
            grad("ta", "q", "p", [5, 1]),
            read("q", 1),
        ],  # fmt: skip
        "grad_with_negative_shape": [create, write, grad("ta", "p", "p", [-1])],
        "grad_with_matrix_shape": [create, write, grad("ta", "p", "p", [[1]])],
    }


CURATED |= _grad_cases()
# Repeated writes to a grad array sum, for number types only (bool is refused).
CURATED |= {f"grad_sum_{dt}": _grad_sum(dt) for dt in ("bool", "int8", "uint64", "float16")}


def make_traces(seed: int, count: int) -> dict[str, list[dict]]:
    rng = np.random.default_rng(seed)
    traces = dict(CURATED)
    for k in range(count):
        traces[f"random_{k:03d}"] = _TraceMaker(rng).steps()
    return traces


def main() -> None:
    record_to(OUT, SEED, make_traces(SEED, TRACES))


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else main()
