"""The stand-in ``cupy`` (``fake_cupy``) accepts nothing that real CuPy refuses.

CI runs the CUDA backend's Python code against the stand-in; that only proves
the backend right for CuPy if the stand-in is no looser than CuPy: every name
the stand-in offers exists in CuPy, and every function or method it defines
takes its parameters under CuPy's names and kinds (a parameter the stand-in
takes by position CuPy takes at the same position; one the stand-in lets a call
omit has a default in CuPy; CuPy requires nothing the stand-in does not); and
its device arrays refuse host arrays where CuPy's do, in CuPy's words.

CuPy's side comes from ``cupy_signatures.json``, recorded from an installed CuPy
by ``record_cupy_signatures.py`` (importing CuPy needs no GPU, nor does anything
recorded), so the comparison runs everywhere; where CuPy is installed (``make
gpu-check``, the ``cuda`` extra) the stand-in is also compared with it directly,
and the recording with it when the versions agree.
"""

from __future__ import annotations

import gc
import inspect
import re
import threading

import numpy as np
import pytest

from tests.kernels import fake_cupy
from tests.kernels import record_cupy_signatures as recorded
from tests.kernels.record_cupy_signatures import (
    RETURNED,
    parse_doc_signature,
    signature_from_record,
    signature_of,
)

#: Classes the CUDA code names only as types, never constructs (their members are checked).
USED_AS_TYPES = {"cupy.ndarray"}
RERECORD = (
    "not in cupy_signatures.json: record it again (tests/kernels/record_cupy_signatures.py, "
    "with CuPy installed)"
)


# ------------------------------------------------------------------ the check
def incompatibilities(fake: inspect.Signature, real: inspect.Signature) -> list[str]:
    """Ways a call the stand-in accepts could fail on CuPy (empty: none)."""
    problems = []
    kinds = inspect.Parameter
    real_params = real.parameters
    real_positional = [
        p.name
        for p in real_params.values()
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    fake_positional = [
        p.name
        for p in fake.parameters.values()
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    real_var_kw = any(p.kind is kinds.VAR_KEYWORD for p in real_params.values())
    real_var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in real_params.values())
    for param in fake.parameters.values():
        if param.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD):
            continue
        if param.kind is kinds.POSITIONAL_ONLY:  # only its place matters
            position = fake_positional.index(param.name)
            if position >= len(real_positional) and not real_var_positional:
                problems.append(f"CuPy takes no positional #{position}")
            continue
        if param.name not in real_params and not real_var_kw:
            problems.append(f"CuPy has no parameter {param.name!r}")
            continue
        if param.name in fake_positional:
            position = fake_positional.index(param.name)
            if position >= len(real_positional) or real_positional[position] != param.name:
                problems.append(f"{param.name!r} is positional #{position} only in the stand-in")
        if param.default is not kinds.empty and param.name in real_params:
            if real_params[param.name].default is kinds.empty:
                problems.append(f"{param.name!r} may be omitted only in the stand-in")
    for param in real_params.values():
        required = param.default is kinds.empty and param.kind not in (
            kinds.VAR_POSITIONAL,
            kinds.VAR_KEYWORD,
        )
        if required and param.name not in fake.parameters:
            problems.append(f"CuPy requires {param.name!r}, the stand-in does not take it")
    return problems


def test_the_signature_check_reports_each_kind_of_looseness():
    real = parse_doc_signature(
        "RawModule(str code=None, *, tuple options=(), name_expressions=None)"
    )

    def positional_options(code, options=()): ...

    def unknown_name(code=None, *, flags=()): ...

    def keywords(code=None, *, options=(), name_expressions=()): ...

    assert incompatibilities(inspect.signature(positional_options), real) == [
        "'options' is positional #1 only in the stand-in"
    ]
    assert incompatibilities(inspect.signature(unknown_name), real) == [
        "CuPy has no parameter 'flags'"
    ]
    assert incompatibilities(inspect.signature(keywords), real) == []
    real = parse_doc_signature("_Base.f(self, int a, b=2) -> int")
    assert list(real.parameters) == ["self", "a", "b"]

    def omits_a(self, a=1, b=2): ...

    def lacks_a(self, b=2): ...

    assert incompatibilities(inspect.signature(omits_a), real) == [
        "'a' may be omitted only in the stand-in"
    ]
    assert incompatibilities(inspect.signature(lacks_a), real) == [
        "'b' is positional #1 only in the stand-in",
        "CuPy requires 'a', the stand-in does not take it",
    ]


# ------------------------------------------------------------------ the stand-in
def stand_in():
    return fake_cupy.make_fake_cupy(shim_lib=None)


def looseness(dotted: str, fake, real: dict) -> list[str]:
    """Ways the stand-in ``fake`` is looser than CuPy's object as ``describe`` tells it."""
    if real["kind"] == "missing":
        return ["the stand-in offers it, CuPy does not"]
    if (
        not callable(fake)
        or isinstance(fake, property)
        or dotted in USED_AS_TYPES
        or dotted.endswith(RETURNED)
    ):
        return []  # existing is all there is to it
    fake_sig = signature_of(fake)
    if fake_sig is None:
        return []
    real_sig = signature_from_record(real)
    if real_sig is None:
        return ["CuPy's signature is unknown"]
    return incompatibilities(fake_sig, real_sig)


def installed_cupy():
    """The installed CuPy (skips where there is none, or where the stand-in is installed)."""
    cupy = pytest.importorskip("cupy")
    if cupy.ndarray is fake_cupy.DeviceArray:
        pytest.skip("the stand-in is installed as cupy")
    return cupy


def test_stand_in_is_no_looser_than_cupy_as_recorded():
    recording = recorded.load()
    names = recorded.stand_in_names(stand_in())
    assert len(names) > 30  # the walk reached the classes' members too
    problems = {
        dotted: looseness(dotted, fake, recording["names"][dotted])
        if dotted in recording["names"]
        else [RERECORD]
        for dotted, fake, _ in names
    }
    assert {d: p for d, p in problems.items() if p} == {}


def test_stand_in_is_no_looser_than_the_installed_cupy():
    cupy = installed_cupy()
    problems = {
        dotted: looseness(dotted, fake, recorded.describe(recorded.lookup(cupy, path)))
        for dotted, fake, path in recorded.stand_in_names(stand_in())
    }
    assert {d: p for d, p in problems.items() if p} == {}


def test_the_recording_is_what_the_installed_cupy_says():
    cupy = installed_cupy()
    recording = recorded.load()
    if recording["cupy"] != cupy.__version__:
        pytest.skip(f"recorded from CuPy {recording['cupy']}, CuPy {cupy.__version__} here")
    live = recorded.record(cupy)
    assert {k: v for k, v in live["names"].items() if k in recording["names"]} == {
        k: v for k, v in recording["names"].items() if k in live["names"]
    }
    assert live["refusals"] == recording["refusals"]


# ------------------------------------------------------------------ host arrays refused
@pytest.mark.parametrize("name", sorted(recorded.REFUSALS))
def test_stand_in_refuses_host_arrays_as_cupy_does(name):
    """Each way of handing a host array to the device (or the device's memory to NumPy)
    that CuPy refuses, the stand-in refuses with CuPy's exception (and words)."""
    want = recorded.load()["refusals"][name]
    got = recorded.refusal(stand_in(), name)
    _, check = recorded.REFUSALS[name]
    assert "raises" in want, want
    if check == "type":
        assert got.get("raises") == want["raises"], got
    else:
        assert got == want


def test_np_asarray_of_a_device_array_raises_and_get_copies():
    cupy = stand_in()
    device = cupy.asarray(np.arange(6.0).reshape(2, 3))
    with pytest.raises(TypeError, match=re.escape(fake_cupy.IMPLICIT_CONVERSION)):
        np.asarray(device)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.testing.assert_array_equal(device, np.zeros((2, 3)))
    host = device.get()
    assert type(host) is np.ndarray and host.tolist() == [[0, 1, 2], [3, 4, 5]]
    host[0, 0] = 7  # a copy: the device array is unchanged
    assert cupy.asnumpy(device)[0, 0] == 0
    assert cupy.transfers == {"to_device": [((2, 3), 48)], "to_host": [((2, 3), 48)] * 2}


def test_a_host_operand_of_a_device_operation_raises():
    """CuPy's elementwise kernels take device arrays and scalars only
    (``_preprocess_args``: "Unsupported type"): not recorded, as CuPy answers those only
    with a GPU, but its source says so (cupy/_core/_kernel.pyx)."""
    cupy = stand_in()
    device, host = cupy.zeros((2, 2)), np.ones((2, 2))
    unsupported = re.escape(f"Unsupported type {np.ndarray}")
    for operation in (
        lambda: device + host,
        lambda: host + device,
        lambda: device * host,
        lambda: host * device,
        lambda: np.add(device, host),
        lambda: np.multiply(host, 2.0, out=device),
    ):
        with pytest.raises(TypeError, match=unsupported):
            operation()
    with pytest.raises(TypeError, match="incorrect type"):
        cupy.matmul(device, host, out=device)
    with pytest.raises(TypeError, match="incorrect type"):
        host @ device
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        device[...] = host
    with pytest.raises(TypeError, match="Only numpy.ndarray"):
        device.set(device)
    with pytest.raises(TypeError, match="float32 array cannot be set to float64 array"):
        device.set(host.astype(np.float32))
    # What CuPy takes: device operands, scalars, and a host array through ``set``.
    device += 1.0
    device[0] = device[1] * 2
    device.set(host)
    assert cupy.asnumpy(device @ device).tolist() == [[2, 2], [2, 2]]


def test_views_share_device_memory_and_copies_do_not():
    cupy = stand_in()
    a = cupy.zeros((3, 4), np.float32)
    a[1:].reshape(8)[...] = 5.0  # a view of a view: written through
    a.T[0] += 1.0
    assert cupy.asnumpy(a).tolist() == [[1, 0, 0, 0], [6, 5, 5, 5], [6, 5, 5, 5]]
    b = a[:, 1:3].reshape(6)  # not expressible as a view: a copy, as in CuPy
    b[...] = -1.0
    assert cupy.asnumpy(a)[0, 1] == 0
    assert isinstance(a[0, 0], fake_cupy.DeviceArray) and a[0, 0].shape == ()
    assert cupy.ascontiguousarray(a) is a and not a.T.flags.c_contiguous
    assert float(a.sum(axis=(0, 1))) == 1 + 6 + 6 + 5 * 6
    assert np.isnan(cupy.asnumpy(cupy.empty(3))).all()  # never written: garbage, not zeros


def test_every_cupy_name_the_cuda_code_uses_is_offered_by_the_stand_in():
    """The walk covers what the CUDA code reaches: every ``cupy.<name>`` and
    ``xp.<name>`` the CUDA backend, the graph cache and the GPU benchmark write is
    a stand-in name (no CuPy needed)."""
    from pathlib import Path

    root = Path(fake_cupy.__file__).parents[2]
    sources = ["kernels/backend_cuda.py", "kernels/cuda_graphs.py", "kernels/device.py"]
    sources += ["kernels/lstm.py", "tests/benchmarks/bench_lstm_gpu.py"]
    used = set()
    for source in sources:
        text = (root / source).read_text()
        used |= set(re.findall(r"\b(?:cupy|xp)\.((?:cuda\.)?(?:runtime\.)?\w+)", text))
    assert {"RawModule", "cuda.MemoryPool", "matmul"} <= used  # the scan found the calls
    names = recorded.stand_in_names(stand_in())
    offered = {d.removeprefix("cupy.").removesuffix(RETURNED) for d, _, _ in names}
    assert used <= offered, used - offered


def test_a_garbage_collection_inside_the_pool_lock_does_not_deadlock():
    """A collection may run a freed buffer's finalizer on a thread that holds the
    default pool's lock (it hung ``make test`` once, in ``test_cuda_graphs``): here one
    runs each time the lock is taken, and the pool still counts every byte."""
    pool = fake_cupy.DefaultPool()

    class CollectingLock:
        def __init__(self) -> None:
            self._lock = threading.Lock()

        def __enter__(self) -> None:
            self._lock.acquire()
            gc.collect()  # the worst moment for a collection

        def __exit__(self, *exc: object) -> None:
            self._lock.release()

    pool._lock = CollectingLock()

    def churn() -> None:
        for _ in range(10):
            buffer = np.empty(1 << 10, np.uint8)
            cycle: list = [buffer]
            cycle.append(cycle)  # freed only by a collection
            pool._track(buffer)
            del buffer, cycle

    worker = threading.Thread(target=churn, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "deadlocked"
    gc.collect()
    assert pool.used_bytes() == 0 and pool.total_bytes() >= 1 << 10
