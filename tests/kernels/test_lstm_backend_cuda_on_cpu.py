"""``backend_cuda`` itself, run on the CPU: fake cupy + the host-shim kernels.

The launches it makes must give exactly the NumPy backend's results on the golden
cases and on float64 cases of both layouts — which checks the kernel argument
order and scalar types that a GPU run would otherwise be the first to see.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from gradserve.kernels import backend_numpy, lstm
from tests.kernels import fake_cupy, lstm_cases, shim_backend
from tests.kernels.lstm_cases import (
    GRADS,
    INDEX,
    INPUTS,
    OUTPUTS,
    forward_attrs,
    golden,
    random_case,
    scaled_error,
)


@pytest.fixture(scope="module")
def backend_cuda(tmp_path_factory):
    lib = shim_backend.build(tmp_path_factory.mktemp("shim"))
    with fake_cupy.installed(lib):
        yield sys.modules["gradserve.kernels.backend_cuda"]


def run(backend, case, length, peep, layout=lstm.GateLayout.IFCO, clip=0.0, bias=0.0):
    out = lstm_cases.forward(
        backend,
        *(case[k] for k in INPUTS),
        seq_len_max=length,
        cell_clip=clip,
        forget_bias=bias,
        use_peephole=peep,
        layout=layout,
    )
    out = lstm.LSTMActivations(*(backend.to_host(a) for a in out))
    grads = lstm_cases.backward(
        backend,
        *(case[k] for k in INPUTS),
        *out,
        case["cs_grad"],
        case["h_grad"],
        seq_len_max=length,
        use_peephole=peep,
        layout=layout,
    )
    return out, lstm.LSTMGrads(*(backend.to_host(a) for a in grads))


@pytest.mark.golden
@pytest.mark.parametrize("name", [c["name"] for c in INDEX])
def test_golden_cases_match_numpy(backend_cuda, name):
    d = golden(name)
    attrs = forward_attrs(d)
    args = (attrs["seq_len_max"], attrs["use_peephole"], attrs["layout"])
    clip, bias = attrs["cell_clip"], attrs["forget_bias"]
    got = run(backend_cuda, d, *args, clip=clip, bias=bias)
    want = run(backend_numpy, d, *args, clip=clip, bias=bias)
    # Both compute in float32 but round differently (std::tanh vs NumPy's SIMD tanh)
    # over 20 steps; a float16 result may then land one float16 ulp (2^-11
    # relative) apart. float64 below is exact.
    tol = 1e-3 if d["x"].dtype == np.float16 else 1e-5
    for k in OUTPUTS:
        assert scaled_error(getattr(got[0], k), getattr(want[0], k)) < tol, k
        assert getattr(got[0], k).dtype == d["x"].dtype
    for k in GRADS:
        assert scaled_error(getattr(got[1], k), getattr(want[1], k)) < tol, k


@pytest.mark.parametrize("layout", list(lstm.GateLayout))
def test_float64_both_layouts(backend_cuda, layout):
    case = random_case(np.random.default_rng(9), steps=4, batch=5, inputs=3, units=7, seq_len_max=3)
    got = run(backend_cuda, case, 3, True, layout, clip=0.3, bias=1.0)
    want = run(backend_numpy, case, 3, True, layout, clip=0.3, bias=1.0)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


def test_module_compiled_once_with_every_instantiation(backend_cuda):
    from gradserve.kernels import cuda_source

    fake = sys.modules["cupy"]
    assert len(fake.compiled) == 1  # compiled once per device
    assert fake.compiled[0]["names"] == cuda_source.name_expressions()
    # Each kernel is looked up once, not on every time step of every call above.
    assert sorted(fake.lookups) == sorted(set(fake.lookups))


@pytest.mark.parametrize("sizes", [(0, 2, 3, 4), (3, 0, 3, 4), (3, 2, 0, 4), (3, 2, 3, 0)])
def test_zero_size_dimensions_match_numpy(backend_cuda, sizes):
    steps, batch, inputs, units = sizes
    case = random_case(
        np.random.default_rng(2), steps=steps, batch=batch, inputs=inputs, units=units
    )
    got = run(backend_cuda, case, steps, True)
    want = run(backend_numpy, case, steps, True)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


def test_a_host_array_is_never_a_kernel_argument(backend_cuda):
    """CuPy launches a RawKernel with device arrays and scalars only: a host array among
    the arguments is CuPy's TypeError on the stand-in too, before anything runs."""
    cupy = sys.modules["cupy"]
    device = cupy.zeros((2, 4), np.float32)
    host = np.zeros((2, 4), np.float32)
    args = [device] * 13
    args[2] = host  # cs_prev
    offsets = lstm.GateLayout.IFCO.offsets(1)
    with pytest.raises(TypeError, match="Unsupported type"):
        backend_cuda.fwd_step(*args, offsets, 0.0, 0.0, False)
