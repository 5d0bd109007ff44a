"""The CUDA kernels, without a GPU: NVRTC compiles them for sm_90, and the same
source, compiled for the CPU through a host shim, matches the NumPy path (its forward
with NumPy's elementwise pass: the CUDA source's tanh and exp are libm's, as close to
the true functions as NumPy's; the compiled CPU step's rational tanh is a few ulps off,
``test_lstm_cpu_native.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from gradserve.kernels import backend_numpy, lstm, lstm_cpu, native
from tests.kernels import lstm_cases, nvrtc, shim_backend
from tests.kernels.lstm_cases import (
    GRADS,
    INDEX,
    INPUTS,
    OUTPUT_GRADS,
    OUTPUTS,
    backward_attrs,
    forward_attrs,
    golden,
    random_case,
    scaled_error,
)

SOURCE = (shim_backend.KERNELS / "lstm.cu").read_text()
NAMES = [f"{k}<{t}>" for k in ("lstm_fwd_step", "lstm_bwd_step") for t in ("float", "double")]


def test_nvrtc_compiles_every_kernel_for_sm90():
    if nvrtc.find_library() is None:
        pytest.fail("libnvrtc missing: `make test` installs nvidia-cuda-nvrtc (dev extra)")
    cubin, lowered = nvrtc.compile_cubin(SOURCE, NAMES, arch="sm_90", options=("--std=c++14",))
    assert cubin[:4] == b"\x7fELF"  # a real cubin
    assert set(lowered) == set(NAMES) and all(v.startswith("_Z") for v in lowered.values())


def test_cuda_backend_instantiates_the_same_names():
    from gradserve.kernels import cuda_source

    assert cuda_source.name_expressions() == NAMES


@pytest.fixture(autouse=True)
def numpys_pass():
    token = lstm_cpu.STEP_KERNEL.set(native.Mode.NUMPY)
    yield
    lstm_cpu.STEP_KERNEL.reset(token)


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    return shim_backend.make_backend(shim_backend.build(tmp_path_factory.mktemp("shim")))


def both(fn, *backends):
    return [fn(b) for b in backends]


@pytest.mark.golden
@pytest.mark.parametrize("name", [c["name"] for c in INDEX if c["dtype"] != "float16"])
def test_host_shim_matches_numpy_on_golden_cases(shim, name):
    d = golden(name)

    def fwd(b):
        return lstm_cases.forward(b, *(d[k] for k in INPUTS), **forward_attrs(d))

    def bwd(b):
        return lstm_cases.backward(
            b, *(d[k] for k in INPUTS + OUTPUTS + OUTPUT_GRADS), **backward_attrs(d)
        )

    (got, want), (ggot, gwant) = both(fwd, shim, backend_numpy), both(bwd, shim, backend_numpy)
    for k in OUTPUTS:
        assert scaled_error(getattr(got, k), getattr(want, k)) < 1e-6, k
    for k in GRADS:
        assert scaled_error(getattr(ggot, k), getattr(gwant, k)) < 1e-6, k


@pytest.mark.parametrize("layout", list(lstm.GateLayout))
@pytest.mark.parametrize("use_peephole", [False, True])
def test_host_shim_matches_numpy_in_float64(shim, layout, use_peephole):
    # 70 cells: more than the shim's 2 x 32 threads, so the grid-stride loop runs.
    case = random_case(
        np.random.default_rng(3), steps=5, batch=7, inputs=4, units=10, seq_len_max=4
    )
    attrs = dict(seq_len_max=4, use_peephole=use_peephole, layout=layout)
    fwd = [
        lstm_cases.forward(b, *(case[k] for k in INPUTS), forget_bias=1.0, cell_clip=0.4, **attrs)
        for b in (shim, backend_numpy)
    ]
    for k in OUTPUTS:
        np.testing.assert_allclose(getattr(fwd[0], k), getattr(fwd[1], k), rtol=0, atol=1e-13)
    bwd = [
        lstm_cases.backward(
            b, *(case[k] for k in INPUTS), *fwd[1], case["cs_grad"], case["h_grad"], **attrs
        )
        for b in (shim, backend_numpy)
    ]
    for k in GRADS:
        np.testing.assert_allclose(getattr(bwd[0], k), getattr(bwd[1], k), rtol=0, atol=1e-12)
