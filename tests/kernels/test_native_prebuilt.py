"""The compiled steps built ahead of time (``python -m gradserve.kernels.native DIR``,
``$GRADSERVE_NATIVE_DIR``): how an image without a compiler serves the compiled steps
and FUSED. The library a level loads computes the bits of the one compiled for this
CPU; a directory that cannot be trusted, or was built from another source, is never
loaded from."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from gradserve.kernels import backend_numpy, blas_threads, lstm, lstm_cpu, native
from gradserve.lstm_signature import LSTMInputs, LSTMOutputGrads
from tests.kernels.lstm_cases import (
    INPUTS,
    OUTPUT_GRADS,
    pinned_forward,
    random_case,
    require_native,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> pathlib.Path:
    """A directory built as the image's build stage builds it: the module run as a
    program, from the checkout, without site-packages (no NumPy, nothing installed)."""
    require_native()
    directory = tmp_path_factory.mktemp("prebuilt") / "native"
    done = subprocess.run(
        [sys.executable, "-S", "-E", "-m", "gradserve.kernels.native", str(directory)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads((directory / native.MANIFEST).read_text())
    return directory


@pytest.fixture
def copy_of(built, tmp_path):
    """A private copy of the built directory (to spoil)."""
    directory = tmp_path / "copy"
    shutil.copytree(built, directory)
    return directory


def _loaded_from(directory: pathlib.Path, monkeypatch) -> native.NativeStep:
    """The process's compiled steps (and FUSED's teams) as a process started with
    ``$GRADSERVE_NATIVE_DIR`` has them, where compiling fails."""
    monkeypatch.setenv(native.PREBUILT_ENV, str(directory))

    def no_compiling():
        raise native.NativeBuildError("compiling is not allowed here")

    monkeypatch.setattr(native, "_compile_and_load", no_compiling)
    step = native.NativeStep()
    monkeypatch.setattr(native, "NATIVE", step)
    monkeypatch.setattr(native, "TEAMS", native.FusedTeams())
    return step


def test_the_build_holds_every_level_of_the_machine_and_a_manifest_of_its_source(built):
    manifest = json.loads((built / native.MANIFEST).read_text())
    assert manifest["source_sha256"] == hashlib.sha256(native.SOURCE.read_bytes()).hexdigest()
    assert list(manifest["libraries"]) == list(native.levels())
    for name in [*manifest["libraries"].values(), native.MANIFEST]:
        mode = os.stat(built / name).st_mode
        assert mode & 0o444 == 0o444 and not mode & 0o022  # all read, only its owner writes
    assert sorted(p.name for p in built.iterdir()) == sorted(
        [*manifest["libraries"].values(), native.MANIFEST]
    )  # no temporary left


def test_a_process_given_the_directory_loads_the_best_level_and_compiles_nothing(
    built, monkeypatch, caplog
):
    with caplog.at_level(logging.INFO, logger="gradserve.kernels"):
        lib = _loaded_from(built, monkeypatch).library()
    assert lib is not None
    best = native.runnable_levels()[0]
    assert pathlib.Path(lib._name).name == f"lstm_cpu_step-{best}.so"
    assert f"built ahead of time for {best}" in caplog.text


@pytest.mark.parametrize("threads", [1, 2])
def test_the_prebuilt_steps_compute_the_bits_of_the_ones_compiled_for_this_cpu(
    built, monkeypatch, threads
):
    """FUSED (one BLAS thread: the caller alone; two: the steps project the input, in a
    team of two), the compiled elementwise step of HOISTED and the compiled backward
    step: the same bits from the best level's library as from ``-march=native``'s."""
    require_native()
    monkeypatch.setattr(blas_threads.BLAS, "plan_count", lambda: threads)
    monkeypatch.setattr(blas_threads.BLAS, "count", lambda: threads)
    monkeypatch.setattr(blas_threads.BLAS, "sleep_soon", lambda: True)
    case = random_case(np.random.default_rng(5), 7, 13, 11, 37, np.float32)

    def compute() -> list[np.ndarray]:
        outs: list[np.ndarray] = []
        for form in (lstm_cpu.Formulation.FUSED, lstm_cpu.Formulation.HOISTED):
            outs += pinned_forward(case, native.Mode.NATIVE, form, seq_len_max=7,
                                   use_peephole=True, cell_clip=0.7)  # fmt: skip
        token = lstm_cpu.STEP_KERNEL.set(native.Mode.NATIVE)
        try:
            grads = lstm.block_lstm_backward(
                backend_numpy, LSTMInputs(*(case[k] for k in INPUTS)), outs[:7],
                LSTMOutputGrads(*(case[k] for k in OUTPUT_GRADS)), seq_len_max=7,
                use_peephole=True,
            )  # fmt: skip
        finally:
            lstm_cpu.STEP_KERNEL.reset(token)
        return [*outs, *grads]

    compiled_here = compute()
    _loaded_from(built, monkeypatch)
    prebuilt = compute()
    assert native.NATIVE.library() is not None
    for a, b in zip(compiled_here, prebuilt, strict=True):
        np.testing.assert_array_equal(a, b)


AVX512 = "fpu sse sse2 ssse3 sse4_1 sse4_2 cx16 lahf_lm popcnt pni avx avx2 bmi1 bmi2 f16c fma abm movbe xsave avx512f avx512bw avx512cd avx512dq avx512vl"  # noqa: E501


def _cpus(*flag_lines: str) -> str:
    return "\n\n".join(
        f"processor\t: {n}\nflags\t\t: {flags}" for n, flags in enumerate(flag_lines)
    )


@pytest.mark.parametrize(
    ("cpuinfo", "machine", "best"),
    [
        (_cpus(AVX512, AVX512), "x86_64", "x86-64-v4"),
        (_cpus(AVX512.replace(" avx512vl", "")), "x86_64", "x86-64-v3"),  # v4 needs all five
        (_cpus(AVX512, AVX512.replace(" avx2", "")), "x86_64", "x86-64-v2"),  # every CPU counts
        (_cpus(AVX512.replace(" popcnt", "")), "x86_64", "x86-64"),  # no v2: no v3, v4 either
        ("processor\t: 0\n", "x86_64", "x86-64"),  # no flags to read: the baseline
        (_cpus(AVX512), "aarch64", native.BASELINE),
    ],
)
def test_the_level_loaded_is_the_best_every_cpu_runs(cpuinfo, machine, best):
    runs = native.runnable_levels(cpuinfo, machine)
    assert runs[0] == best
    assert runs == native.levels(machine)[native.levels(machine).index(best) :]


def _manifest(directory: pathlib.Path, **changes) -> None:
    path = directory / native.MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (lambda d: os.chmod(d, 0o777), "others can write"),
        (lambda d: os.chmod(d / native.MANIFEST, 0o666), "others can write"),
        (lambda d: (d / native.MANIFEST).unlink(), "missing"),
        (lambda d: (d / native.MANIFEST).write_text("{"), "unreadable"),
        (lambda d: _manifest(d, libraries=["x"]), "unreadable"),
        (lambda d: _manifest(d, source_sha256="0" * 64), "another lstm_cpu_step.c"),
        (lambda d: _manifest(d, machine="riscv64"), "another machine"),
        (lambda d: _manifest(d, libraries={lv: "../x.so" for lv in native.levels()}),
         "not a file of root"),
        (lambda d: [os.chmod(p, 0o775) for p in d.glob("*.so")], "not a file of root"),
        (lambda d: [p.unlink() for p in d.glob("*.so")], "not a file of root"),
        (lambda d: [p.write_bytes(b"not ELF") for p in d.glob("*.so")], "failed to load"),
    ],
)  # fmt: skip
def test_a_directory_that_cannot_be_trusted_or_does_not_fit_is_not_loaded(copy_of, spoil, why):
    spoil(copy_of)
    with pytest.raises(native.NativeBuildError, match=why):
        native.load_prebuilt(copy_of)


def test_a_directory_without_a_level_this_cpu_runs_is_not_loaded(copy_of):
    _manifest(copy_of, libraries={"x86-64-v4": "lstm_cpu_step-x86-64-v4.so"})
    with pytest.raises(native.NativeBuildError, match="no library this CPU runs"):
        native.load_prebuilt(copy_of, cpuinfo=_cpus(AVX512.replace(" avx512f", "")))


def test_where_the_directory_is_not_loaded_the_step_is_compiled_and_both_reasons_said(
    copy_of, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv("GRADSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(native.PREBUILT_ENV, str(copy_of))
    _manifest(copy_of, source_sha256="0" * 64)
    with caplog.at_level(logging.WARNING, logger="gradserve.kernels"):
        assert native.NativeStep().library() is not None  # compiled here instead
    assert "another lstm_cpu_step.c" in caplog.text and "compiling the step here" in caplog.text
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # and where nothing compiles
    monkeypatch.delenv("CC", raising=False)
    step = native.NativeStep()
    assert step.library() is None
    assert "no C compiler" in step.failure and "another lstm_cpu_step.c" in step.failure
