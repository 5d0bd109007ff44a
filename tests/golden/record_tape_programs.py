"""Record TensorFlow 1.x graph-mode ``tf.gradients`` of random programs into
``tape_programs.json``: the oracle that ``tests/server/test_tape_golden.py`` replays
through the gradient tape.

A *program* is what a worker runs under ``client.gradient_tape()``: resident inputs
(``Put``), TensorArray ops of every kind, ``StopGradient`` and ``BlockLSTM`` (V1), then
one ``gradient`` call, or two on one persistent tape. TensorFlow runs it in graph mode
with control flow v1 (``disable_eager_execution``, ``disable_control_flow_v2``), so its
TensorArrays are ``TensorArrayV3`` ops and ``tf.gradients`` goes through the registered
gradients of ``tensor_array_grad.py``, ``array_grad.py`` and ``rnn_grad.py``, each call
with its own ``TensorArrayGradV3`` source ("gradients", "gradients_1").

Install TensorFlow by hand to re-record (it is no dependency of gradserve); seeded, so
a re-recording is byte-identical:

    python3 -m venv /tmp/tf && /tmp/tf/bin/pip install "tensorflow-cpu==2.21.*" ml_dtypes
    cd tests/golden && /tmp/tf/bin/python record_tape_programs.py

File format (``{"recorded_with", "seed", "programs": {name: program}}``), each program:

* ``kind``: ``ta`` (TensorArray ops), ``stop`` (with StopGradient), ``lstm`` (BlockLSTM V1
  chains through TensorArrays), ``size0`` (a split or scatter into a size-0 array),
  ``gate_target`` (an LSTM gate among the targets); ``dtype``.
* ``ops``: steps ``{op, args, out}`` in the golden trace format (``trace_format``): ``op``
  is a ``tf.raw_ops`` name, or ``Put`` (a resident tensor, ``client.put``; a
  ``tf.constant`` in TensorFlow); in ``args``, ``"$name"`` is an earlier output and a
  ``{"array", "dtype", "shape"}`` object an inline (constant) tensor. ``out`` names the
  outputs (all of them, in ``tf.raw_ops`` order; ``TensorArrayCloseV3`` has none).
* ``gradients``: the calls, in order, each ``{targets, sources, output_gradients,
  unconnected_gradients, expect}``: ``targets``/``sources`` name outputs,
  ``output_gradients`` is ``null`` (ones) or one tensor per target, and ``expect`` is
  TensorFlow's answer: ``{"grads": [result or null per source]}`` (``result`` as in the
  trace format) or ``{"error": <TF error class>, "message": ...}`` (TensorFlow's message
  without its graph-execution wrapping, array names as ``ta1_N``). Where ours differs on
  purpose (README), ``ours`` says what ours answers instead: ``{"grads": [...]}`` (the
  empty gradient of a split/scatter into a size-0 array, where TensorFlow raises
  UNIMPLEMENTED), None for a source the targets do not depend on although they depend
  on another output of its BlockLSTM (``tf.gradients`` zero-fills the op's other
  outputs' gradients, so it says zeros; ``tf.GradientTape`` and ours say None), or
  ``{"error": "UnimplementedError", "output": "i"}`` (a target that is an LSTM gate:
  TensorFlow silently gives zeros for it).
* ``filled`` (present where set): TensorFlow 2.21 died (SIGSEGV) in this program's
  gradient — the Concat of a grad array with unwritten elements (the gradient of a
  split whose elements were not all read). It was recorded again with one more read of
  each such element, at the end of the forward, as a target with a zero output
  gradient: those elements then hold zeros, the value ours gives them; the program in
  the file is the original one. ``filled`` lists those reads (``[array, index]``).

What makes TensorFlow's graph deterministic here (a tape runs the ops in program order,
and differentiates after the whole forward): every op on a TensorArray has control
dependencies on the earlier ops on that array (reads and gathers produce no flow, so
a dynamic array could otherwise grow under a concat, or a close overtake a read), and
every ``TensorArrayGradV3`` on all forward ops (otherwise the grad array of a read in
the middle of a dynamic array's growth could be created, and its size frozen, before
the later writes). The session runs on one thread.

Recorded LSTM programs keep ``cell_clip`` inactive (disabled, or ``3.0`` with |cs| below
it, checked here): TensorFlow's LSTM gradient ignores the clip, ours masks clipped cells
(tested against finite differences in ``tests/server/test_tape_properties.py``).
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

import numpy as np

if __package__:  # imported by the property test, as tests.golden.record_tape_programs
    from .trace_format import dtype_of, result, tensor, tensor_value
else:  # run as a script from tests/golden
    from trace_format import dtype_of, result, tensor, tensor_value

OUT = pathlib.Path(__file__).parent / "tape_programs.json"
SEED = 1515
#: Programs per kind (names ``<kind>_NNN``).
COUNTS = {"ta": 160, "stop": 70, "lstm": 60, "size0": 12, "gate_target": 10}
TA_DTYPES = ["float32", "float32", "float64", "float16"]
ELEMENT_SHAPES = [(2,), (3,), (2, 2), (), (1, 3)]
LSTM_GATES = ("i", "f", "o", "ci", "co")
LSTM_OUTPUTS = ("i", "cs", "f", "o", "ci", "co", "h")


class _Array:
    """The maker's model of one TensorArray, so that the forward it writes is valid."""

    def __init__(self, name: str, flow: str, size: int, dynamic: bool, clear: bool) -> None:
        self.name = name
        self.flow = flow  # the latest flow: every op uses it (program order)
        self.size = size
        self.dynamic = dynamic
        self.clear = clear  # clear_after_read
        self.shape: tuple = ()  # the element shape (elem mode), or the tail (split mode)
        self.split = False  # elements [len, *tail] of uneven lengths
        self.written: dict[int, tuple] = {}  # index -> element shape
        self.cleared: set[int] = set()  # read with clear_after_read
        self.closed = False

    def readable(self) -> list[int]:
        return sorted(i for i in self.written if i not in self.cleared)

    def fresh(self) -> list[int]:
        """Indices a write may take: unwritten in range, and past the end if dynamic."""
        free = [i for i in range(self.size) if i not in self.written]
        return free + ([self.size, self.size + 1] if self.dynamic else [])


class ProgramMaker:
    """One random program, drawn from ``rng`` (a NumPy ``Generator``; only its
    ``integers``). The property test makes its programs with it too."""

    def __init__(self, rng, kind: str, dtype: str) -> None:
        self.rng = rng
        self.kind = kind
        self.dtype = dtype
        self.ops: list[dict] = []
        self.shapes: dict[str, tuple] = {}  # every tensor of the program's dtype
        self.puts: list[str] = []
        self.outputs: list[str] = []  # differentiable op outputs: target candidates
        self.arrays: list[_Array] = []
        self.used: set[str] = set()
        self.names = 0

    # ---------------------------------------------------------------- choices
    def pick(self, n: int) -> int:
        return int(self.rng.integers(0, n))

    def coin(self, percent: int) -> bool:
        return self.pick(100) < percent

    def choice(self, items: list):
        return items[self.pick(len(items))]

    def weighted(self, weights: dict[str, int]) -> str:
        draw = self.pick(sum(weights.values()))
        for key, weight in weights.items():
            if draw < weight:
                return key
            draw -= weight
        raise AssertionError("unreachable")

    def ref(self, name: str) -> str:
        """``$name``, an argument: ``name`` is now used."""
        self.used.add(name)
        return f"${name}"

    def data(self, shape: tuple, scale: int = 4) -> np.ndarray:
        """Small multiples of 1/scale: exact in float16, short in JSON."""
        values = np.asarray(self.rng.integers(-8, 9, size=shape)).reshape(shape)
        return (values / scale).astype(self.dtype)

    def name(self, prefix: str) -> str:
        self.names += 1
        return f"{prefix}{self.names}"

    # ---------------------------------------------------------------- values
    def put(self, shape: tuple, scale: int = 4) -> str:
        name = self.name("x")
        self.ops.append({"op": "Put", "args": {"value": tensor(self.data(shape, scale))},
                         "out": [name]})  # fmt: skip
        self.shapes[name] = shape
        self.puts.append(name)
        return name

    def value_for(self, shape: tuple):
        """An argument of ``shape``: an earlier tensor, a new resident one, or a constant."""
        draw = self.pick(10)
        earlier = [n for n, s in self.shapes.items() if s == shape]
        if draw < 5 and earlier:
            return self.ref(self.choice(earlier))
        if draw < 9:
            return self.ref(self.put(shape))
        return tensor(self.data(shape))

    def output(self, prefix: str, shape: tuple) -> str:
        name = self.name(prefix)
        self.shapes[name] = shape
        self.outputs.append(name)
        return name

    # ---------------------------------------------------------------- arrays
    def new_array(
        self, split: bool = False, size: int | None = None, shape: tuple | None = None
    ) -> _Array:
        """A new array; of fixed ``size`` where given, of elements ``shape`` (or
        ``[len, *shape]`` where ``split``) where given."""
        dynamic = size is None and self.coin(35)
        if size is None:
            size = self.pick(3) if dynamic else 1 + self.pick(4)
        ta = _Array(self.name("ta"), self.name("f"), size, dynamic, self.coin(50))
        ta.split = split
        if split:
            ta.shape = (2 + self.pick(2),) if shape is None else shape
            declared = self.choice([None, [None, *ta.shape]])
            identical = False
        else:
            ta.shape = self.choice(ELEMENT_SHAPES) if shape is None else shape
            declared = self.choice([None, list(ta.shape)] + ([[None, *ta.shape[1:]]] if ta.shape else []))  # fmt: skip
            identical = self.coin(50)
        args = {"size": size, "dtype": self.dtype, "element_shape": declared,
                "dynamic_size": dynamic, "clear_after_read": ta.clear,
                "identical_element_shapes": identical, "tensor_array_name": ta.name}  # fmt: skip
        self.ops.append({"op": "TensorArrayV3", "args": args, "out": [ta.name, ta.flow]})
        self.arrays.append(ta)
        return ta

    def open_arrays(self) -> list[_Array]:
        return [ta for ta in self.arrays if not ta.closed]

    def write(self, ta: _Array) -> bool:
        fresh = ta.fresh()
        if not fresh:
            return False
        index = self.choice(fresh)
        shape = (self.pick(3), *ta.shape) if ta.split else ta.shape
        value = self.value_for(shape)
        self._step(ta, "TensorArrayWriteV3", {"index": index, "value": value})
        ta.written[index] = shape
        ta.size = max(ta.size, index + 1)
        return True

    def _step(self, ta: _Array, op: str, args: dict) -> None:
        """A step that changes ``ta``: takes its flow, gives the next one."""
        flow_in, ta.flow = ta.flow, self.name("f")
        self.ops.append({"op": op, "args": {"handle": f"${ta.name}", **args,
                         "flow_in": f"${flow_in}"}, "out": [ta.flow]})  # fmt: skip

    def _read_args(self, ta: _Array) -> dict:
        return {"handle": f"${ta.name}", "flow_in": f"${ta.flow}"}

    def read(self, ta: _Array) -> bool:
        readable = ta.readable()
        if not readable:
            return False
        index = self.choice(readable)
        name = self.output("r", ta.written[index])
        args = {**self._read_args(ta), "index": index, "dtype": self.dtype}
        self.ops.append({"op": "TensorArrayReadV3", "args": args, "out": [name]})
        if ta.clear:
            ta.cleared.add(index)
        return True

    def gather(self, ta: _Array) -> bool:
        readable = ta.readable()
        if not readable:
            return False
        first = self.choice(readable)
        same = [i for i in readable if ta.written[i] == ta.written[first]]
        indices = [first]
        for _ in range(self.pick(3)):
            pool = same if not ta.clear else [i for i in same if i not in indices]
            if pool:
                indices.append(self.choice(pool))
        shape = ta.written[first]
        name = self.output("g", (len(indices), *shape))
        args = {
            **self._read_args(ta),
            "indices": tensor(np.array(indices, np.int32)),
            "dtype": self.dtype,
            "element_shape": None,
        }
        # TensorFlow merges a gather's element_shape into the array's: not in split mode.
        if not ta.split:
            args["element_shape"] = self.choice([None, list(shape)])
        self.ops.append({"op": "TensorArrayGatherV3", "args": args, "out": [name]})
        if ta.clear:
            ta.cleared.update(indices)
        return True

    def scatter(self, ta: _Array) -> bool:
        fresh = ta.fresh()
        if ta.split or not fresh:
            return False
        indices: list[int] = []
        for _ in range(1 + self.pick(min(3, len(fresh)))):
            indices.append(self.choice([i for i in fresh if i not in indices]))
        value = self.value_for((len(indices), *ta.shape))
        self._step(ta, "TensorArrayScatterV3",
                   {"indices": tensor(np.array(indices, np.int32)), "value": value})  # fmt: skip
        for i in indices:
            ta.written[i] = ta.shape
        ta.size = max([ta.size] + [i + 1 for i in indices])
        return True

    def concat(self, ta: _Array) -> bool:
        if ta.size == 0 or sorted(ta.readable()) != list(range(ta.size)):
            return False
        shapes = [ta.written[i] for i in range(ta.size)]
        if not shapes[0] or any(s[1:] != shapes[0][1:] for s in shapes):
            return False
        tail = shapes[0][1:]
        value = self.output("c", (sum(s[0] for s in shapes), *tail))
        args = {**self._read_args(ta), "dtype": self.dtype,
                "element_shape_except0": self.choice([None, list(tail)])}  # fmt: skip
        self.ops.append({"op": "TensorArrayConcatV3", "args": args,
                         "out": [value, self.name("lengths")]})  # fmt: skip
        if ta.clear:
            ta.cleared.update(range(ta.size))
        return True

    def split(self, ta: _Array) -> bool:
        if ta.written or not ta.shape:
            return False
        n = ta.size if not ta.dynamic else max(ta.size, 1 + self.pick(3))
        # Split mode: uneven lengths (0 too); else each element the array's shape.
        lengths = [self.pick(3) if ta.split else ta.shape[0] for _ in range(n)]
        tail = ta.shape if ta.split else ta.shape[1:]
        value = self.value_for((sum(lengths), *tail))
        self._step(ta, "TensorArraySplitV3", {"value": value,
                   "lengths": tensor(np.array(lengths, np.int64))})  # fmt: skip
        ta.written = {i: (length, *tail) for i, length in enumerate(lengths)}
        ta.size = n
        return True

    def size_op(self, ta: _Array) -> bool:
        args = self._read_args(ta)
        self.ops.append({"op": "TensorArraySizeV3", "args": args, "out": [self.name("n")]})
        return True

    def close(self, ta: _Array) -> bool:
        self.ops.append({"op": "TensorArrayCloseV3", "args": {"handle": f"${ta.name}"},
                         "out": []})  # fmt: skip
        ta.closed = True
        return True

    def stop(self) -> bool:
        candidates = self.outputs + self.puts
        if not candidates:
            return False
        source = self.choice(candidates)
        name = self.output("s", self.shapes[source])
        self.ops.append({"op": "StopGradient", "args": {"input": self.ref(source)}, "out": [name]})
        return True

    # ---------------------------------------------------------------- programs
    def ta_program(self) -> None:
        weights = {"write": 30, "read": 20, "gather": 8, "scatter": 6, "concat": 6,
                   "split": 6, "size": 2, "close": 1, "new": 4,
                   "stop": 12 if self.kind == "stop" else 0}  # fmt: skip
        self.new_array(split=self.coin(25))
        for _ in range(4 + self.pick(10)):
            op = self.weighted(weights)
            arrays = self.open_arrays()
            if op == "stop":
                self.stop()
            elif op == "new" or not arrays:
                if len(self.arrays) < 3:
                    self.new_array(split=self.coin(25))
            else:
                getattr(self, {"size": "size_op"}.get(op, op))(self.choice(arrays))
        # At least one target: a read of something, else a gather or concat.
        if not self.outputs:
            for ta in self.open_arrays():
                if self.read(ta) or self.concat(ta):
                    break

    def size0_program(self) -> None:
        """A split or scatter of an empty value into a size-0 array, then a concat or
        gather of it (with the element shape the forward needs)."""
        ta = self.new_array(split=True, size=0)
        tail = list(ta.shape)
        if self.coin(50):
            value = self.put((0, *ta.shape))
            self._step(ta, "TensorArraySplitV3", {"value": self.ref(value),
                       "lengths": tensor(np.zeros(0, np.int64))})  # fmt: skip
        else:
            value = self.put((0, 1, *ta.shape))
            self._step(ta, "TensorArrayScatterV3", {"value": self.ref(value),
                       "indices": tensor(np.zeros(0, np.int32))})  # fmt: skip
        if self.coin(50):
            out = self.output("c", (0, *ta.shape))
            args = {**self._read_args(ta), "dtype": self.dtype, "element_shape_except0": tail}
            self.ops.append({"op": "TensorArrayConcatV3", "args": args,
                             "out": [out, self.name("lengths")]})  # fmt: skip
        else:
            out = self.output("g", (0, 1, *ta.shape))
            args = {**self._read_args(ta), "indices": tensor(np.zeros(0, np.int32)),
                    "dtype": self.dtype, "element_shape": [1, *tail]}  # fmt: skip
            self.ops.append({"op": "TensorArrayGatherV3", "args": args, "out": [out]})

    def lstm(self, x: str | dict, t: int, b: int, i: int, h: int, cs_prev: str, h_prev: str,
             seq_len_max: int) -> dict[str, str]:  # fmt: skip
        """A BlockLSTM (V1) call on resident weights; its outputs' names."""
        weights = {"w": (i + h, 4 * h), "wci": (h,), "wcf": (h,), "wco": (h,), "b": (4 * h,)}
        args = {"seq_len_max": tensor(np.array(seq_len_max, np.int64)), "x": x,
                "cs_prev": self.ref(cs_prev), "h_prev": self.ref(h_prev)}  # fmt: skip
        for key, shape in weights.items():
            args[key] = self.ref(self.put(shape, scale=16))
        # cs stays below 0.5 + T <= 2.5 when T <= 2: a clip of 3 never acts.
        clips = [-1.0, 0.0] + ([3.0] if t <= 2 else [])
        args |= {"forget_bias": self.choice([1.0, 0.5]), "cell_clip": self.choice(clips),
                 "use_peephole": self.coin(50)}  # fmt: skip
        outs = {k: self.name(k) for k in LSTM_OUTPUTS}
        self.ops.append({"op": "BlockLSTM", "args": args, "out": list(outs.values())})
        for name in outs.values():
            self.shapes[name] = (t, b, h)
        self.outputs += [outs["cs"], outs["h"]]
        return outs

    def _state(self, b: int, h: int) -> str:
        """An initial state [B, H]: resident, or written to an array and read back."""
        if self.coin(60):
            return self.put((b, h), scale=16)
        ta = self.new_array(size=1, shape=(b, h))
        self._step(ta, "TensorArrayWriteV3", {"index": 0, "value": self.ref(self.put((b, h), 16))})
        ta.written[0] = (b, h)
        self.read(ta)
        return self.outputs.pop()  # an input, not a target candidate

    def lstm_program(self) -> dict[str, str]:
        t, b, i, h = 1 + self.pick(3), 1 + self.pick(2), 1 + self.pick(3), 1 + self.pick(2)
        seq_len_max = t - 1 if t > 1 and self.coin(20) else t
        # x: resident, or steps written into an array and stacked (gathered).
        if self.coin(35):
            x = self.ref(self.put((t, b, i), scale=16))
        else:
            ta = self.new_array(size=t, shape=(b, i))
            for step in range(t):
                if self.coin(70):
                    self._step(ta, "TensorArrayWriteV3",
                               {"index": step, "value": self.ref(self.put((b, i), 16))})  # fmt: skip
                    ta.written[step] = (b, i)
            missing = [s for s in range(t) if s not in ta.written]
            if missing:
                value = self.put((len(missing), b, i), 16)
                self._step(ta, "TensorArrayScatterV3", {"value": self.ref(value),
                           "indices": tensor(np.array(missing, np.int32))})  # fmt: skip
                for s in missing:
                    ta.written[s] = (b, i)
            name = self.name("xs")
            args = {**self._read_args(ta), "indices": tensor(np.arange(t, dtype=np.int32)),
                    "dtype": self.dtype, "element_shape": [b, i]}  # fmt: skip
            self.ops.append({"op": "TensorArrayGatherV3", "args": args, "out": [name]})
            self.shapes[name] = (t, b, i)
            x = f"${name}"
        outs = self.lstm(x, t, b, i, h, self._state(b, h), self._state(b, h), seq_len_max)
        # h (or cs) into an array: scattered per step or split in uneven blocks of steps.
        for key in ("h", "cs") if self.coin(30) else ("h",):
            if self.coin(50):
                out = self.new_array(size=t, shape=(b, h))
                self._step(out, "TensorArrayScatterV3", {"value": f"${outs[key]}",
                           "indices": tensor(np.arange(t, dtype=np.int32))})  # fmt: skip
                out.written = dict.fromkeys(range(t), (b, h))
            else:
                out = self.new_array(split=True, size=t, shape=(b, h))
                cut = sorted(self.pick(t + 1) for _ in range(t - 1))
                lengths = np.diff([0, *cut, t]).astype(np.int64)
                self._step(out, "TensorArraySplitV3", {"value": f"${outs[key]}",
                           "lengths": tensor(lengths)})  # fmt: skip
                out.written = {k: (int(n), b, h) for k, n in enumerate(lengths)}
            for _ in range(1 + self.pick(3)):
                self.choice([self.read, self.gather, self.concat])(out)
            # A second LSTM fed from the array, its x the stacked h.
            if key == "h" and not out.split and not out.cleared and self.coin(30):
                name = self.name("hs")
                args = {**self._read_args(out), "indices": tensor(np.arange(t, dtype=np.int32)),
                        "dtype": self.dtype, "element_shape": [b, h]}  # fmt: skip
                self.ops.append({"op": "TensorArrayGatherV3", "args": args, "out": [name]})
                self.shapes[name] = (t, b, h)
                self.lstm(f"${name}", t, b, h, h, self._state(b, h), self._state(b, h), t)
        return outs

    # ---------------------------------------------------------------- gradients
    def gradient_call(self, targets_from: list[str]) -> dict:
        targets = []
        for _ in range(1 + self.pick(3)):
            name = self.choice(targets_from)
            if name not in targets:
                targets.append(name)
        if self.puts and self.coin(8):  # a source as its own target
            targets.append(self.choice(self.puts))
        used = [p for p in self.puts if p in self.used] or self.puts
        sources = []
        for _ in range(1 + self.pick(4)):
            name = self.choice(used)
            if name not in sources:
                sources.append(name)
        if self.outputs and self.coin(20):  # an intermediate tensor
            name = self.choice(self.outputs)
            if name not in sources:
                sources.append(name)
        unused = [p for p in self.puts if p not in self.used]
        if unused and self.coin(50):
            sources.append(self.choice(unused))
        output_gradients = None
        if self.coin(40):
            output_gradients = [tensor(self.data(self.shapes[t])) for t in targets]
        return {"targets": targets, "sources": sources, "output_gradients": output_gradients,
                "unconnected_gradients": "zero" if self.coin(20) else "none"}  # fmt: skip

    def program(self) -> dict | None:
        calls = []
        if self.kind in ("ta", "stop"):
            self.ta_program()
            if self.puts and self.coin(25):
                self.put(self.choice(ELEMENT_SHAPES))  # never used: a None gradient
            if not self.outputs or not self.puts:
                return None
            calls = [self.gradient_call(self.outputs) for _ in range(1 + self.coin(30))]
        elif self.kind == "size0":
            self.size0_program()
            calls = [{"targets": list(self.outputs), "sources": list(self.puts),
                      "output_gradients": None, "unconnected_gradients": "none"}]  # fmt: skip
        elif self.kind == "lstm":
            self.lstm_program()
            calls = [self.gradient_call(self.outputs) for _ in range(1 + self.coin(30))]
        elif self.kind == "gate_target":
            outs = self.lstm_program()
            call = self.gradient_call(self.outputs)
            gate = self.choice(list(LSTM_GATES))
            call["targets"].append(outs[gate])
            if call["output_gradients"] is not None:
                call["output_gradients"].append(tensor(self.data(self.shapes[outs[gate]])))
            call["gate"] = gate
            calls = [call]
        return {"kind": self.kind, "dtype": self.dtype, "ops": self.ops, "gradients": calls,
                "fill": self.fill()}  # fmt: skip

    def fill(self) -> list[list]:
        """The reads that would write every unwritten grad element (see ``filled``)."""
        return [[ta.name, i] for ta in self.open_arrays() for i in ta.readable()]


def make_programs(seed: int) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    programs = {}
    for kind, count in COUNTS.items():
        made = 0
        while made < count:
            dtype = "float32" if kind in ("lstm", "gate_target") else str(rng.choice(TA_DTYPES))
            program = ProgramMaker(rng, kind, dtype).program()
            if program is not None:
                programs[f"{kind}_{made:03d}"] = program
                made += 1
    return programs


# -------------------------------------------------------------------- TensorFlow side
def _build_forward(tf, program: dict, fill: list):
    """The program's forward in the default graph: its outputs by name, all its ops,
    each BlockLSTM's (cs, cell_clip), and the ``fill`` reads."""
    env: dict = {}
    on_array: dict[str, list] = {}  # array name -> its ops so far (control dependencies)
    flows: dict[str, str] = {}  # array name -> its latest flow
    lstms = []
    for step in program["ops"]:
        if step["op"] == "Put":
            env[step["out"][0]] = tf.constant(tensor_value(step["args"]["value"]))
            continue
        args = {}
        for key, value in step["args"].items():
            if isinstance(value, str) and value.startswith("$"):
                args[key] = env[value[1:]]
            elif isinstance(value, dict):
                args[key] = tf.constant(tensor_value(value))
            elif key == "dtype":
                args[key] = tf.as_dtype(value)
            elif key in ("element_shape", "element_shape_except0"):
                args[key] = tf.TensorShape(value)
            else:
                args[key] = value
        array = step["out"][0] if step["op"] == "TensorArrayV3" else step["args"].get("handle")
        array = array and array.lstrip("$")
        with tf.control_dependencies(on_array.get(array, [])):
            outputs = getattr(tf.raw_ops, step["op"])(**args)
        if isinstance(outputs, tf.Operation):  # Close: no outputs
            op, outputs = outputs, []
        else:
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            op = outputs[0].op
        env.update(zip(step["out"], outputs))
        if array:
            on_array.setdefault(array, []).append(op)
            if step["op"] in ("TensorArrayV3", "TensorArrayWriteV3", "TensorArrayScatterV3",
                              "TensorArraySplitV3"):  # fmt: skip
                flows[array] = step["out"][-1]
        if step["op"] == "BlockLSTM":
            lstms.append((outputs[1], step["args"]["cell_clip"]))
    fills = []
    for array, index in fill:  # reads added at the end (``filled``)
        with tf.control_dependencies(on_array[array]):
            fills.append(tf.raw_ops.TensorArrayReadV3(
                handle=env[array], index=index, flow_in=env[flows[array]],
                dtype=tf.as_dtype(program["dtype"])))  # fmt: skip
    forward = tf.compat.v1.get_default_graph().get_operations()
    return env, forward, lstms, fills


def _gradient_call(tf, env: dict, call: dict, forward: list, fills: list):
    targets = [env[t] for t in call["targets"]]
    grad_ys = call["output_gradients"]
    grad_ys = None if grad_ys is None else [tf.constant(tensor_value(g)) for g in grad_ys]
    if fills:
        grad_ys = grad_ys or [tf.ones_like(t) for t in targets]
        grad_ys = grad_ys + [tf.zeros_like(f) for f in fills]
        targets = targets + fills
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    grads = tf.compat.v1.gradients(
        targets, [env[s] for s in call["sources"]], grad_ys=grad_ys,
        unconnected_gradients=tf.UnconnectedGradients(call["unconnected_gradients"]),
    )  # fmt: skip
    for op in graph.get_operations()[before:]:
        if op.type == "TensorArrayGradV3":
            op._add_control_inputs(forward)  # after the whole forward (module docstring)
    return grads


def tf_message(message: str) -> str:
    """TensorFlow's message without its graph-execution wrapping (the line before the
    node), array names made generic (``ta1_473`` -> ``ta1_N``: TensorFlow's counter
    runs on across programs)."""
    line = message.split("\n\t [[")[0].split("\n")[-1]
    return re.sub(r"\b(ta\d+)_\d+", r"\1_N", line).strip()


def run_program(tf, program: dict, fill: list, report) -> None:
    """Build the program and each gradient call in a fresh graph; ``report`` the
    forward's check, then each call's expectation as it completes (a crash then shows
    which call killed TensorFlow)."""
    with tf.Graph().as_default():
        env, forward, lstms, fills = _build_forward(tf, program, fill)
        calls = [_gradient_call(tf, env, call, forward, fills) for call in program["gradients"]]
        config = tf.compat.v1.ConfigProto(
            inter_op_parallelism_threads=1, intra_op_parallelism_threads=1
        )
        with tf.compat.v1.Session(config=config) as sess:
            try:
                _, cs = sess.run([forward, [c for c, _ in lstms]])
            except tf.errors.OpError as e:
                report({"forward_error": type(e).__name__, "message": e.message})
                return
            # Whether a cell_clip acted (TensorFlow's LSTM gradient ignores it).
            clipped = [bool(clip > 0 and np.abs(c).max(initial=0) >= clip)
                       for c, (_, clip) in zip(cs, lstms)]  # fmt: skip
            report({"clipped": clipped})
            for grads in calls:
                present = [g for g in grads if g is not None]
                try:
                    values = iter(sess.run(present))
                except tf.errors.OpError as e:
                    report({"error": type(e).__name__, "message": tf_message(e.message)})
                    continue
                out = [None if g is None else result(next(values), g.dtype.name) for g in grads]
                report({"grads": out})


def worker() -> None:
    """Programs (one JSON line each, ``{"program", "fill"}``) on stdin; each step's
    report printed as it completes, then ``END``."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.disable_control_flow_v2()
    print("READY", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        report = lambda r: print(json.dumps(r), flush=True)  # noqa: E731
        try:
            run_program(tf, job["program"], job["fill"], report)
        except (ValueError, TypeError) as e:  # TensorFlow refused to build the graph
            report({"forward_error": type(e).__name__, "message": str(e)})
        print("END", flush=True)


class _Worker:
    def __init__(self) -> None:
        self.proc = None

    def run(self, program: dict, fill: list) -> list[dict] | None:
        """The reports, or None where TensorFlow died."""
        from tf_record import _start_worker  # the same worker start (READY handshake)

        if self.proc is None:
            self.proc = _start_worker()
        self.proc.stdin.write(json.dumps({"program": program, "fill": fill}) + "\n")
        self.proc.stdin.flush()
        reports = []
        for line in self.proc.stdout:
            if line.strip() == "END":
                return reports
            reports.append(json.loads(line))
        self.proc.wait()
        self.proc = None
        return None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()


def _empty_grads(program: dict, call: dict) -> dict:
    """Ours where TensorFlow cannot pack a size-0 grad array: the empty gradients."""
    shapes = {s["out"][0]: s["args"]["value"]["shape"] for s in program["ops"] if s["op"] == "Put"}
    dtype = program["dtype"]
    return {"grads": [result(np.zeros(shapes[s], dtype_of(dtype))) for s in call["sources"]]}


def _upstream(program: dict, targets: list[str]) -> set[str]:
    """The targets and every tensor they depend on (through op inputs and flows)."""
    inputs = {}
    for step in program["ops"]:
        names = {v[1:] for k, v in step["args"].items() if isinstance(v, str) and k != "handle"}
        for out in step["out"]:
            inputs[out] = names
    seen, todo = set(), list(targets)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += inputs.get(name, ())
    return seen


def _unconnected_outputs(program: dict, call: dict) -> dict | None:
    """Ours where TensorFlow's graph gives zeros for a source the targets do not
    depend on: an output of a BlockLSTM another of whose outputs they depend on
    (``tf.gradients`` zero-fills the op's other outputs' gradients, and the source's
    gradient is that zero; ours, like ``tf.GradientTape``, says None)."""
    expect = call["expect"]
    if "grads" not in expect or call["unconnected_gradients"] != "none":
        return None
    upstream = _upstream(program, call["targets"])
    lstm_outputs = {o for s in program["ops"] if s["op"] == "BlockLSTM" for o in s["out"]}
    grads = list(expect["grads"])
    for k, source in enumerate(call["sources"]):
        if grads[k] is not None and source not in upstream:
            assert source in lstm_outputs, (source, call)  # no other op does this
            grads[k] = None
    return None if grads == expect["grads"] else {"grads": grads}


def record(programs: dict[str, dict]) -> dict[str, dict]:
    worker_ = _Worker()
    recorded = {}
    for name, program in programs.items():
        fill = program.pop("fill")
        reports = worker_.run(program, [])
        filled = False
        if reports is None:  # TensorFlow died: again with the fill reads
            reports, filled = worker_.run(program, fill), True
            if reports is None:
                raise RuntimeError(f"{name}: TensorFlow died even with the fill reads")
        head, *expects = reports
        if "forward_error" in head:
            raise RuntimeError(f"{name}: the forward failed in TensorFlow: {head}")
        if any(head["clipped"]):
            raise RuntimeError(f"{name}: a cell_clip acted, which TensorFlow's gradient ignores")
        for call, expect in zip(program["gradients"], expects, strict=True):
            call["expect"] = expect
            if program["kind"] == "size0" and expect.get("error") == "UnimplementedError":
                call["ours"] = _empty_grads(program, call)
            if (ours := _unconnected_outputs(program, call)) is not None:
                call["ours"] = ours
            if "gate" in call:
                call["ours"] = {"error": "UnimplementedError", "output": call.pop("gate")}
        if filled:
            program["filled"] = fill
        recorded[name] = program
    worker_.close()
    return recorded


def main() -> None:
    import tensorflow as tf

    programs = record(make_programs(SEED))
    meta = {"recorded_with": f"tensorflow {tf.__version__}", "seed": SEED, "programs": programs}
    OUT.write_text(json.dumps(meta, separators=(",", ":")) + "\n")
    kinds: dict[str, int] = {}
    for p in programs.values():
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    errors = sum("error" in c["expect"] for p in programs.values() for c in p["gradients"])
    filled = sum("filled" in p for p in programs.values())
    print(f"{len(programs)} programs {kinds}, {errors} gradient calls TensorFlow refused, "
          f"{filled} recorded with fill reads, {OUT.stat().st_size} bytes, written to {OUT}")  # fmt: skip


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else main()
