"""The CPU forward's fused elementwise step (``lstm_cpu_step.c``), compiled for this host.

NumPy runs a step's elementwise pass as about twenty ufunc calls, each a pass over
memory and a call's overhead; at (50, 32, 256) they cost 3 ms of a 15 ms forward with
one BLAS thread, against TensorFlow's Eigen expressions fused in one pass. The C
source does the pass in one loop. No binary ships with the package (the core install
stays pure Python); as CuPy compiles its kernels with NVRTC on first use and PyTorch's
inductor compiles C++ with the host's compiler, the source is compiled here on first
use with the host's C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) for this
CPU (``-march=native``) and cached, keyed by the source, the flags, the compiler's
version and the CPU, so a cache shared between machines never hands one another's
instructions.

Where no compiler is found, or it fails, or the cache cannot be trusted, the forward
runs its NumPy pass as before (``Mode.AUTO``); a server started with
``--cpu-step-kernel native`` refuses to start instead, and ``numpy`` never compiles.
The two passes give other last bits (the C step's tanh is a rational function within
a few ulps, NumPy's within one or two), so replicas meant to agree bit for bit pin
the mode as they pin ``--lstm-formulation``.

The cache directory (``$GRADSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/gradserve``,
else ``~/.cache/gradserve``) is made private (0700); a directory or library owned by
another user, or writable by others, is never loaded from (anyone who can write there
could run code in the server): a fresh private temporary directory is used instead.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import stat
import subprocess
import tempfile
import threading

log = logging.getLogger("gradserve.kernels")

SOURCE = pathlib.Path(__file__).with_name("lstm_cpu_step.c")
#: ``-ffp-contract=off``: no fused multiply-adds, so the backward step gives the NumPy
#: passes' bits (Clang contracts within an expression by default, GCC outside ISO C).
FLAGS = ("-O3", "-march=native", "-std=c99", "-ffp-contract=off", "-fPIC", "-shared")
#: Seconds a compilation may take before it counts as failed.
COMPILE_TIMEOUT_SECONDS = 120
STEP = "gradserve_lstm_forward_step_f32"
BACKWARD_F32 = "gradserve_lstm_backward_step_f32"
BACKWARD_F64 = "gradserve_lstm_backward_step_f64"
TANH = "gradserve_rational_tanh_f32"


class Mode(enum.Enum):
    """``--cpu-step-kernel``: which elementwise pass the CPU forward runs in float32."""

    AUTO = "auto"  # the compiled step where it builds, else NumPy's
    NATIVE = "native"  # the compiled step, or an error
    NUMPY = "numpy"  # NumPy's, never compiling


class NativeBuildError(RuntimeError):
    """The compiled step could not be built or loaded here (the message says why)."""


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(dict.fromkeys(keep))  # one line of each kind per distinct CPU


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    raise NativeBuildError("no C compiler found ($CC, cc, gcc, clang)")


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(f"{compiler} --version failed: {e}") from e
    return done.stdout


def _private(directory: pathlib.Path) -> bool:
    """Owned by this user and writable by no one else (a symlink is not followed)."""
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.getuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def cache_dir() -> pathlib.Path:
    """The configured cache directory, made if missing; a private temporary one when it
    cannot be made or is not private."""
    configured = os.environ.get("GRADSERVE_CACHE_DIR")
    if configured:
        directory = pathlib.Path(configured)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = pathlib.Path(base) / "gradserve"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        pass
    if _private(directory):
        return directory
    log.warning("cache %s is missing or not private: compiling into a temporary one", directory)
    return pathlib.Path(tempfile.mkdtemp(prefix="gradserve-native-"))


def _build(directory: pathlib.Path, compiler: str, key: str) -> pathlib.Path:
    """Compile into ``directory`` under a name made of ``key``: to a temporary name
    first, then renamed, so a concurrent builder or reader never sees half a file."""
    target = directory / f"lstm_cpu_step-{key}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        try:
            done = subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", tmp],
                capture_output=True, text=True, timeout=COMPILE_TIMEOUT_SECONDS,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            raise NativeBuildError(f"{compiler} failed to run: {e}") from e
        if done.returncode != 0:
            raise NativeBuildError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _trusted(library: pathlib.Path) -> bool:
    try:
        st = os.lstat(library)
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == os.getuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def build_and_load() -> ctypes.CDLL:
    """The compiled step's library, built now unless cached (NativeBuildError if not)."""
    compiler = _compiler()
    source = SOURCE.read_bytes()
    parts = (source, " ".join(FLAGS).encode(), _compiler_version(compiler).encode())
    key = hashlib.sha256(b"\0".join((*parts, _cpu_identity().encode()))).hexdigest()[:32]
    directory = cache_dir()
    library = _build(directory, compiler, key)
    if not _trusted(library):
        raise NativeBuildError(f"{library} is not a private file of this user: not loaded")
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as e:
        raise NativeBuildError(f"{library} failed to load: {e}") from e
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    ptr, long_, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    step = getattr(lib, STEP)
    step.argtypes = [ptr, long_, ptr, long_, ptr, ptr, ptr, *[long_] * 6, f32, *[ptr] * 7]
    step.restype = None
    tanh = getattr(lib, TANH)
    tanh.argtypes = [ptr, ptr, long_]
    tanh.restype = None
    for name, real in ((BACKWARD_F32, ctypes.c_float), (BACKWARD_F64, ctypes.c_double)):
        backward = getattr(lib, name)
        # dh, dcs, i, f, o, ci, co, cs, cs_last, h_grad, cs_grad, peep; clip_at; batch,
        # units, the four offsets; dgates
        backward.argtypes = [*[ptr] * 12, real, *[long_] * 6, ptr]
        backward.restype = None


class NativeStep:
    """The compiled step's library, built once per process on first use.

    ``library()`` gives the loaded library, or None where it cannot be built here
    (``failure`` says why; the NumPy pass serves then, and later calls do not try
    again). Thread-safe: one thread builds while the others wait for it. Which pass a
    forward runs is the caller's ``Mode`` (``lstm_cpu.STEP_KERNEL``); a server asks
    here at start, so that ``native`` fails there and no op pays the compilation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._failure: str | None = None

    def library(self) -> ctypes.CDLL | None:
        with self._lock:
            if self._lib is None and self._failure is None:
                try:
                    self._lib = build_and_load()
                    log.info("CPU forward: the compiled elementwise step (%s)", SOURCE.name)
                except NativeBuildError as e:
                    self._failure = str(e)
                    log.warning("CPU forward: NumPy's elementwise pass (%s)", e)
            return self._lib

    @property
    def failure(self) -> str | None:
        """Why the build failed (None: it did not, or none was tried)."""
        return self._failure

    def reset(self) -> None:
        """Forget the library and any failure (the tests; a later call builds again)."""
        with self._lock:
            self._lib = None
            self._failure = None


NATIVE = NativeStep()
