"""Random op sequences (hypothesis) against a small, obviously-right model.

The model is a dict of written values plus sets of read and cleared indices;
multi-index ops apply to a copy and commit only if every index succeeds (our
all-or-nothing rule). The same sequences run on the pure state machine (many
examples) and through a real server (fewer), and every result and every
error/no-error outcome must agree.
"""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradserve import errors
from gradserve.server.core.tensor_array import TensorArray


class ModelError(Exception):
    pass


class Model:
    def __init__(self, size: int, dynamic: bool, clear: bool) -> None:
        self.size, self.dynamic, self.clear = size, dynamic, clear
        self.values: dict[int, np.ndarray] = {}
        self.written: set[int] = set()
        self.read_: set[int] = set()
        self.cleared: set[int] = set()
        self.closed = False

    def _open(self):
        if self.closed:
            raise ModelError("closed")

    def write(self, i, x):
        self._open()
        if i < 0 or (not self.dynamic and i >= self.size):
            raise ModelError("range")
        if i in self.read_ or i in self.written:
            raise ModelError("once")
        self.values[i] = x
        self.written.add(i)
        self.size = max(self.size, i + 1)

    def read(self, i):
        self._open()
        if i < 0 or i >= self.size or i not in self.written or i in self.cleared:
            raise ModelError("read")
        x = self.values[i]
        self.read_.add(i)
        if self.clear:
            del self.values[i]
            self.cleared.add(i)
        return x

    def atomically(self, fn):
        trial = copy.deepcopy(self)
        result = fn(trial)
        self.__dict__.update(trial.__dict__)
        return result

    def gather(self, idx):
        self._open()
        return self.atomically(lambda m: np.stack([m.read(i) for i in idx]))

    def scatter(self, idx, xs):
        self._open()
        size = max(self.size, max(idx) + 1) if self.dynamic else self.size
        if max(idx) >= size:
            raise ModelError("max index")
        return self.atomically(lambda m: [m.write(i, x) for i, x in zip(idx, xs)] and None)

    def size_(self):
        self._open()
        return self.size

    def close(self):
        self.values.clear()
        self.closed = True


indices = st.integers(-1, 6)
ops = st.one_of(
    st.tuples(st.just("write"), indices),
    st.tuples(st.just("read"), indices),
    st.tuples(st.just("gather"), st.lists(indices, min_size=1, max_size=4)),
    st.tuples(st.just("scatter"), st.lists(indices, min_size=1, max_size=4)),
    st.tuples(st.just("size"), st.none()),
    st.tuples(st.just("close"), st.none()),
)
scenarios = st.tuples(
    st.integers(0, 5), st.booleans(), st.booleans(), st.lists(ops, min_size=1, max_size=25)
)


def run(scenario, apply) -> list:
    """Outcomes of the scenario under ``apply(op, arg, value) -> result or raise``."""
    size, dynamic, clear, sequence = scenario
    outcomes = []
    for n, (op, arg) in enumerate(sequence):
        value = np.float32(n) + np.arange(2, dtype=np.float32)
        if op == "scatter":
            value = np.stack([value + 10 * k for k in range(len(arg))])
        try:
            result = apply(op, arg, value)
            outcomes.append(("ok", None if result is None else np.asarray(result).tolist()))
        except (ModelError, errors.InvalidArgumentError):
            outcomes.append(("error", None))
    return outcomes


def model_outcomes(scenario):
    m = Model(*scenario[:3])
    table = {
        "write": lambda i, x: m.write(i, x),
        "read": lambda i, x: m.read(i),
        "gather": lambda idx, x: m.gather(idx),
        "scatter": lambda idx, x: m.scatter(idx, x),
        "size": lambda _, x: m.size_(),
        "close": lambda _, x: m.close(),
    }
    return run(scenario, lambda op, arg, x: table[op](arg, x))


def new_array(scenario, element_shape=None) -> TensorArray:
    size, dynamic, clear, _ = scenario
    return TensorArray(
        name="ta",
        dtype=np.dtype(np.float32),
        size=size,
        dynamic_size=dynamic,
        clear_after_read=clear,
        element_shape=element_shape,
    )


def apply_to(ta: TensorArray):
    """``run``'s ``apply`` on the state machine ``ta``."""
    table = {
        "write": lambda i, x: ta.write(i, x),
        "read": lambda i, x: ta.read(i),
        "gather": lambda idx, x: ta.gather(idx, None),
        "scatter": lambda idx, x: ta.scatter(idx, x),
        "size": lambda _, x: ta.size(),
        "close": lambda _, x: ta.close(),
    }
    return lambda op, arg, x: table[op](arg, x)


def machine_outcomes(scenario):
    return run(scenario, apply_to(new_array(scenario)))


def server_outcomes(client, scenario):
    size, dynamic, clear, _ = scenario
    raw = client.raw_ops
    h, flow = raw.TensorArrayV3(
        size=size, dtype=np.float32, dynamic_size=dynamic, clear_after_read=clear
    )
    f32 = np.float32
    table = {
        "write": lambda i, x: (raw.TensorArrayWriteV3(h, i, x, flow), None)[1],
        "read": lambda i, x: raw.TensorArrayReadV3(h, i, flow, f32),
        "gather": lambda idx, x: raw.TensorArrayGatherV3(h, idx, flow, f32),
        "scatter": lambda idx, x: (raw.TensorArrayScatterV3(h, idx, x, flow), None)[1],
        "size": lambda _, x: raw.TensorArraySizeV3(h, flow),
        "close": lambda _, x: raw.TensorArrayCloseV3(h),
    }
    return run(scenario, lambda op, arg, x: table[op](arg, x))


@settings(max_examples=400, deadline=None)
@given(scenarios)
def test_state_machine_matches_model(scenario):
    assert machine_outcomes(scenario) == model_outcomes(scenario)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scenario=scenarios)
def test_server_matches_model(client, scenario):
    assert server_outcomes(client, scenario) == model_outcomes(scenario)


def test_model_is_not_trivial():
    """The model does reject things (so agreement above means something)."""
    outcomes = model_outcomes(
        (1, False, True, [("write", 0), ("write", 0), ("read", 0), ("read", 0)])
    )
    assert [o[0] for o in outcomes] == ["ok", "error", "ok", "error"]


@settings(max_examples=300, deadline=None)
@given(scenarios, st.booleans())
def test_every_state_the_ops_reach_a_snapshot_restores(scenario, shaped):
    """``TensorArray.from_state`` refuses states no ops could make (a hand-edited
    file): every state the ops do make, of a forward array and of its gradient array
    (soft copies, reads past the end), must pass its checks and come back the same."""
    forward = new_array(scenario, element_shape=(2,) if shaped else None)
    arrays = [forward]
    run(scenario, apply_to(forward))
    if not forward.closed:
        try:
            arrays.append(forward.make_grad(name="ta@gradients"))
        except errors.InvalidArgumentError:
            pass  # (multiple writes aggregated: no gradient array)
        else:
            run(scenario, apply_to(arrays[1]))
    forward.close()
    for ta in arrays:
        state = ta.export_state()
        assert TensorArray.from_state(state).export_state().slots.keys() == state.slots.keys()
