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
import platform
import shutil
import stat
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


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file_of(lib) -> pathlib.Path:
    """The file a library was loaded from (a prebuilt one: by its descriptor)."""
    return pathlib.Path(os.path.realpath(lib._name))


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
    assert manifest["source_sha256"] == _sha256(native.SOURCE)
    assert list(manifest["libraries"]) == list(native.levels())
    names = [lib["file"] for lib in manifest["libraries"].values()]
    for lib in manifest["libraries"].values():
        assert lib["sha256"] == _sha256(built / lib["file"])
    for name in [*names, native.MANIFEST]:
        mode = os.stat(built / name).st_mode
        assert mode & 0o444 == 0o444 and not mode & 0o022  # all read, only its owner writes
    assert sorted(p.name for p in built.iterdir()) == sorted([*names, native.MANIFEST])


def test_a_process_given_the_directory_loads_the_best_level_and_compiles_nothing(
    built, monkeypatch, caplog
):
    with caplog.at_level(logging.INFO, logger="gradserve.kernels"):
        lib = _loaded_from(built, monkeypatch).library()
    assert lib is not None
    best = native.runnable_levels()[0]
    assert _file_of(lib) == built.resolve() / f"lstm_cpu_step-{best}.so"
    assert f"built ahead of time for {best}" in caplog.text


@pytest.mark.parametrize("threads", [1, 2])
def test_the_prebuilt_steps_compute_the_bits_of_the_ones_compiled_for_this_cpu(
    built, monkeypatch, threads
):
    """FUSED's forward (one BLAS thread: the caller alone; two: the steps project the
    input, in a team of two) and backward, and the compiled elementwise step of
    HOISTED: the same bits from the best level's library as from ``-march=native``'s."""
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


def _libraries(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(directory.glob("*.so"))


def _relink(path: pathlib.Path) -> None:
    """``path`` replaced by a link to a copy of it (the same bytes, owner and mode)."""
    copy = path.with_name(path.name + ".copy")
    shutil.copy2(path, copy)
    path.unlink()
    path.symlink_to(copy.name)


def _other_library(directory: pathlib.Path) -> None:
    """Each library replaced by another level's: a real library, other bytes (a
    rebuild cut short leaves such a directory)."""
    libs = _libraries(directory)
    for lib, other in zip(libs, libs[1:] + libs[:1]):
        shutil.copy(other, lib.with_suffix(".tmp"))
    for lib in libs:
        os.replace(lib.with_suffix(".tmp"), lib)


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        pytest.param(lambda d: os.chmod(d, 0o777), "others can write", id="dir-writable"),
        pytest.param(lambda d: os.chmod(d / native.MANIFEST, 0o666), "others can write",
                     id="manifest-writable"),
        pytest.param(lambda d: (d / native.MANIFEST).unlink(), "No such file",
                     id="no-manifest"),
        pytest.param(lambda d: _relink(d / native.MANIFEST), "symbolic links",
                     id="manifest-a-link"),
        pytest.param(lambda d: (d / native.MANIFEST).write_text("{"), "unreadable",
                     id="manifest-not-json"),
        pytest.param(lambda d: (d / native.MANIFEST).write_text("[" * 100_000 + "]" * 100_000),
                     "unreadable", id="manifest-nested-deep"),
        pytest.param(lambda d: _manifest(d, libraries=["x"]), "unreadable",
                     id="manifest-of-no-libraries"),
        pytest.param(lambda d: _manifest(d, source_sha256="0" * 64), "another lstm_cpu_step.c",
                     id="another-source"),
        pytest.param(lambda d: _manifest(d, machine="riscv64"), "another machine",
                     id="another-machine"),
        pytest.param(lambda d: _manifest(d, libraries={lv: {"file": "../x.so", "sha256": ""}
                                                       for lv in native.levels()}),
                     "not a file name", id="a-path-for-a-name"),
        pytest.param(lambda d: _manifest(d, libraries={lv: {"file": "a\0b", "sha256": ""}
                                                       for lv in native.levels()}),
                     "not a file name", id="a-nul-in-a-name"),
        pytest.param(lambda d: [os.chmod(p, 0o775) for p in _libraries(d)], "others can write",
                     id="libraries-writable"),
        pytest.param(lambda d: [_relink(p) for p in _libraries(d)], "symbolic links",
                     id="libraries-links"),
        pytest.param(lambda d: [p.unlink() for p in _libraries(d)], "No such file",
                     id="no-libraries"),
        pytest.param(_other_library, "bytes are not those", id="other-libraries"),
        pytest.param(lambda d: [p.write_bytes(b"not ELF") for p in _libraries(d)],
                     "bytes are not those", id="libraries-not-elf"),
    ],
)  # fmt: skip
def test_a_directory_that_cannot_be_trusted_or_does_not_fit_is_not_loaded(copy_of, spoil, why):
    spoil(copy_of)
    with pytest.raises(native.NativeBuildError, match=why):
        native.load_prebuilt(copy_of)


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
@pytest.mark.parametrize("what", ["directory", "manifest", "library"])
def test_files_of_another_user_are_not_loaded(copy_of, what):
    path = {"directory": copy_of, "manifest": copy_of / native.MANIFEST}.get(what)
    for target in [path] if path else _libraries(copy_of):
        os.chown(target, NOBODY, NOBODY)
    with pytest.raises(native.NativeBuildError, match="not owned by root or this user"):
        native.load_prebuilt(copy_of)


def test_a_link_to_the_directory_is_followed_and_what_it_opened_is_checked(copy_of, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(copy_of)
    lib, _ = native.load_prebuilt(link)
    assert _file_of(lib).parent == copy_of.resolve()
    os.chmod(copy_of, 0o777)
    with pytest.raises(native.NativeBuildError, match="others can write"):
        native.load_prebuilt(link)


def test_the_directory_is_checked_as_opened_not_by_its_path(copy_of, tmp_path, monkeypatch):
    """A directory swapped in under the path after it was opened is not what is read
    (a parent others can write: a review helper loaded a library so)."""
    evil = tmp_path / "evil"
    shutil.copytree(copy_of, evil)
    for lib in _libraries(evil):
        lib.write_bytes(b"not ELF")
    real_open = os.open
    swapped = []

    def open_then_swap(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if not swapped and flags & os.O_DIRECTORY:
            os.rename(copy_of, tmp_path / "moved")
            os.rename(evil, copy_of)
            swapped.append(fd)
        return fd

    monkeypatch.setattr(native.os, "open", open_then_swap)
    lib, _ = native.load_prebuilt(copy_of)  # the libraries of the directory it opened
    assert swapped and _file_of(lib).parent == tmp_path / "moved"


def test_prebuild_writes_nothing_through_a_link_planted_in_its_directory(tmp_path):
    """Its temporaries are made exclusively: links planted at every name a fixed
    scheme would use lead nowhere (a review helper had the manifest's overwrite and
    chmod a root-only file)."""
    require_native()
    directory, victim = tmp_path / "native", tmp_path / "victim"
    directory.mkdir()
    victim.write_text("root's")
    os.chmod(victim, 0o600)
    planted = [f".{native.MANIFEST}", *(f".build-lstm_cpu_step-{lv}.so" for lv in native.levels())]
    for name in planted:
        (directory / name).symlink_to(victim)
    native.prebuild(directory)
    assert victim.read_text() == "root's" and stat.S_IMODE(os.stat(victim).st_mode) == 0o600
    native.load_prebuilt(directory)


def test_a_library_that_loads_but_lacks_the_steps_spoils_no_later_load(copy_of, tmp_path):
    """A library loaded from /proc/self/fd/N and then refused keeps its descriptor: a
    number closed and reused named the refused library to dlopen again, and a good
    directory loaded after it was refused (a review helper)."""
    stub = tmp_path / "stub"
    shutil.copytree(copy_of, stub)
    source = tmp_path / "stub.c"
    source.write_text("int gradserve_nothing(void) { return 0; }\n")
    manifest = json.loads((stub / native.MANIFEST).read_text())
    for lib in manifest["libraries"].values():
        path = stub / lib["file"]
        path.unlink()
        done = subprocess.run(
            [*native._compiler(), "-shared", "-fPIC", str(source), "-o", str(path)]
        )
        assert done.returncode == 0
        lib["sha256"] = _sha256(path)
    (stub / native.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(native.NativeBuildError, match="lacks the steps' functions"):
        native.load_prebuilt(stub)
    lib, _ = native.load_prebuilt(copy_of)
    assert _file_of(lib).parent == copy_of.resolve()


def test_prebuild_refuses_a_directory_others_can_write(tmp_path):
    require_native()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(native.NativeBuildError, match="not a directory of this user or root"):
        native.prebuild(shared)
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(not native._x86_64(platform.machine()), reason="x86-64's levels")
def test_a_directory_without_a_level_this_cpu_runs_is_not_loaded(copy_of):
    manifest = json.loads((copy_of / native.MANIFEST).read_text())
    _manifest(copy_of, libraries={"x86-64-v4": manifest["libraries"]["x86-64-v4"]})
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
