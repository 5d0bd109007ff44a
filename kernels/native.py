"""The CPU LSTM's compiled steps (``lstm_cpu_step.c``), compiled for this host: the
fused elementwise steps, and the FUSED formulation's (``pack``, ``fused_steps``, its
teams of threads ``TEAMS``, ``flushing_subnormals``).

NumPy runs a forward step's elementwise pass as about twenty ufunc calls (a backward
step's as about fifteen), each a pass over memory and a call's overhead; at (50, 32,
256) they cost 3 ms of a 15 ms forward with one BLAS thread, against TensorFlow's
Eigen expressions fused in one pass. The C source does each in one loop. No binary
ships with the package (the core install stays pure Python); as CuPy compiles its
kernels with NVRTC on first use and PyTorch's inductor compiles C++ with the host's
compiler, the source is compiled here on first use with the host's C compiler
(``$CC``, split as a shell would, else ``cc``, ``gcc`` or ``clang``) for this CPU
(``-march=native``, where ``/proc/cpuinfo`` tells the CPU apart: else for the
architecture's baseline) and cached, keyed by the source, the compiler's command,
flags and version, and the CPU, so a cache shared between machines never hands one
another's instructions.

Where no compiler is found, or it fails (or runs past ``COMPILE_TIMEOUT_SECONDS``:
killed with what it started), or the cache cannot be trusted, or anything else goes
wrong, the passes stay NumPy's (``Mode.AUTO``), said once in the log; a server
started with ``--cpu-step-kernel native`` refuses to start instead, and ``numpy``
never compiles. The backward step gives NumPy's bits (a NaN's sign aside); the
forward's does not (its
tanh is a rational function within 7 ulps, NumPy's within one), so replicas meant to
agree bit for bit pin the mode as they pin ``--lstm-formulation``.

The cache directory (``$GRADSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/gradserve``,
else ``~/.cache/gradserve``; its links resolved) is made private (0700); a directory
or library owned by another user, or writable by others, is never loaded from
(anyone who can write there could run code in the server): a fresh private
temporary directory is used instead, removed once the library is loaded.

Where no compiler may run (a container image, a read-only filesystem), the libraries
are built ahead of time (``python -m gradserve.kernels.native DIR``, as
``docker/Dockerfile`` does in a stage of its own): one per x86-64 level (the psABI's
``x86-64-v4`` .. ``x86-64``; elsewhere the architecture's baseline), with a manifest
naming the source they were built from. A process with ``$GRADSERVE_NATIVE_DIR`` set
loads the best level its CPU runs from there (``prebuilt``), compiling nothing; a
directory built from another source, or that someone else could write, is not loaded
from (said in the log, and the step is then compiled where a compiler is found). A
level's library computes what ``-march=native`` compiles on that CPU does, bit for bit
(the source fixes every operation's order; what a level adds is the vector width,
which does not change the bits, and from ``x86-64-v3`` on fused multiply-adds, which
do: ``v3`` and ``v4`` give the same bits, ``v2`` and ``x86-64`` others, measured by a
review helper).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import hashlib
import json
import logging
import os
import pathlib
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("gradserve.kernels")

SOURCE = pathlib.Path(__file__).with_name("lstm_cpu_step.c")
#: ``-ffp-contract=off``: no fused multiply-adds, so the backward step gives the NumPy
#: passes' bits (Clang contracts within an expression by default, GCC outside ISO C).
FLAGS = ("-O3", "-march=native", "-std=c99", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
#: Seconds a compilation (and the compiler's ``--version``) may take before it is killed
#: and counts as failed: a forward of the process waits for the build meanwhile.
COMPILE_TIMEOUT_SECONDS = 60
VERSION_TIMEOUT_SECONDS = 15
STEP = "gradserve_lstm_forward_step_f32"
BACKWARD_F32 = "gradserve_lstm_backward_step_f32"
BACKWARD_F64 = "gradserve_lstm_backward_step_f64"
TANH = "gradserve_rational_tanh_f32"
TANH_FMA = "gradserve_rational_tanh_fma_f32"
PACKED_FLOATS = "gradserve_lstm_packed_floats"
PACK = "gradserve_lstm_pack_f32"
FUSED_STEPS = "gradserve_lstm_forward_fused_steps_f32"
CLAIMS = "gradserve_fused_step_claims"
TEAM_START = "gradserve_fused_team_start"
TEAM_STOP = "gradserve_fused_team_stop"
PACKED_T_FLOATS = "gradserve_lstm_packed_transposed_floats"
PACK_T = "gradserve_lstm_pack_transposed_f32"
BACKWARD_FUSED_STEP = "gradserve_lstm_backward_fused_step_f32"
BACKWARD_FUSED_STEPS = "gradserve_lstm_backward_fused_steps_f32"
BACKWARD_CLAIMS = "gradserve_backward_fused_step_claims"
FLUSH = "gradserve_flush_subnormals"
RESTORE = "gradserve_restore_fp_mode"
ANY_SUBNORMAL = "gradserve_any_subnormal_f32"


class Mode(enum.Enum):
    """``--cpu-step-kernel``: which elementwise pass the CPU forward runs in float32."""

    AUTO = "auto"  # the compiled step where it builds, else NumPy's
    NATIVE = "native"  # the compiled step, or an error
    NUMPY = "numpy"  # NumPy's, never compiling


class NativeBuildError(RuntimeError):
    """The compiled step could not be built or loaded here (the message says why)."""


#: The lines of ``/proc/cpuinfo`` that say what ``-march=native`` compiles for: x86's
#: model and feature flags, ARM's implementer, part, variant and features.
CPU_IDENTITY_KEYS = frozenset(
    ("vendor_id", "cpu family", "model", "model name", "stepping", "flags",
     "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision",
     "Features", "isa", "uarch")
)  # fmt: skip


def _cpuinfo() -> str:
    """The text of ``/proc/cpuinfo``, "" where it cannot be read."""
    try:
        return pathlib.Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_identity(cpuinfo: str | None = None) -> str:
    """What ``-march=native`` compiles for (``cpuinfo``: the text of ``/proc/cpuinfo``,
    read here when None): "" where it cannot be told, and then the step is compiled
    for the machine's baseline instead (``flags``), never for a CPU a shared cache
    could not tell from another."""
    if cpuinfo is None:
        cpuinfo = _cpuinfo()
    keep = [ln for ln in cpuinfo.splitlines() if ln.split(":")[0].strip() in CPU_IDENTITY_KEYS]
    if not keep:
        return ""
    # one line of each kind per distinct CPU, with the architecture's name
    return "\n".join((platform.machine(), *dict.fromkeys(ln.strip() for ln in keep)))


def flags(identity: str) -> tuple[str, ...]:
    """The compiler's flags: ``-march=native`` only where the CPU can be told apart."""
    return FLAGS if identity else tuple(f for f in FLAGS if f != "-march=native")


def _compiler() -> list[str]:
    """The compiler's command: ``$CC`` (split as a shell would: "ccache gcc" works),
    else ``cc``, ``gcc`` or ``clang``."""
    configured = os.environ.get("CC")
    if configured:
        args = shlex.split(configured)
        if args and (path := shutil.which(args[0])):
            return [path, *args[1:]]
        log.warning("$CC=%r names no executable: trying cc, gcc, clang", configured)
    for name in ("cc", "gcc", "clang"):
        if path := shutil.which(name):
            return [path]
    raise NativeBuildError("no C compiler found ($CC, cc, gcc, clang)")


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` in a session of its own, killed with everything it started (the
    driver's cc1, as, ld) if it runs past ``timeout``."""
    try:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            errors="replace", start_new_session=True,
        )  # fmt: skip
    except OSError as e:
        raise NativeBuildError(f"{command[0]} failed to run: {e}") from e
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise NativeBuildError(f"{' '.join(command[:2])} ran past {timeout} s: killed") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _compiler_version(compiler: list[str]) -> str:
    done = _run([*compiler, "--version"], VERSION_TIMEOUT_SECONDS)
    if done.returncode != 0:
        raise NativeBuildError(f"{compiler[0]} --version failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def _only_theirs(
    st: os.stat_result, is_kind: Callable[[int], bool], owners: tuple[int, ...]
) -> bool:
    """Of that kind (``stat.S_ISDIR``, ``S_ISREG``), owned by one of ``owners`` and
    writable by no one else: only they could have put code there."""
    return (
        is_kind(st.st_mode)
        and st.st_uid in owners
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _path_only_theirs(
    path: pathlib.Path, is_kind: Callable[[int], bool], owners: tuple[int, ...]
) -> bool:
    """``path`` itself (a link is not followed) is ``_only_theirs``."""
    try:
        return _only_theirs(os.lstat(path), is_kind, owners)
    except OSError:
        return False


def _private(path: pathlib.Path, is_kind: Callable[[int], bool] = stat.S_ISDIR) -> bool:
    """``path`` is this user's only: the cache, which this user writes."""
    return _path_only_theirs(path, is_kind, (os.getuid(),))


def configured_cache_dir() -> pathlib.Path:
    """``$GRADSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/gradserve``, else
    ``~/.cache/gradserve``."""
    configured = os.environ.get("GRADSERVE_CACHE_DIR")
    if configured:
        return pathlib.Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "gradserve"


def cache_dir() -> tuple[pathlib.Path, bool]:
    """The cache directory, made if missing, with its links resolved (the checks and
    every use name the same directory), and whether it is a temporary one: a fresh
    private directory when the configured one cannot be made or is not private (the
    caller removes it once the library is loaded)."""
    directory = configured_cache_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory = directory.resolve(strict=True)
    except (OSError, RuntimeError):
        pass
    if _private(directory):
        return directory, False
    log.warning("cache %s cannot be made or is not private: compiling into a temporary one",
                directory)  # fmt: skip
    return pathlib.Path(tempfile.mkdtemp(prefix="gradserve-native-")), True


def _build(
    directory: pathlib.Path, compiler: list[str], build_flags: tuple[str, ...], key: str
) -> pathlib.Path:
    """Compile into ``directory`` under a name made of ``key``: to a temporary name
    first, then renamed, so a concurrent builder or reader never sees half a file."""
    target = directory / f"lstm_cpu_step-{key}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = _run(
            [*compiler, *build_flags, str(SOURCE), "-lm", "-o", tmp], COMPILE_TIMEOUT_SECONDS
        )
        if done.returncode != 0:
            raise NativeBuildError(f"{compiler[0]} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return target


def build_and_load() -> ctypes.CDLL:
    """The compiled step's library: built ahead of time where ``$GRADSERVE_NATIVE_DIR``
    names a directory this process may load from, else built now unless cached
    (NativeBuildError if neither: the message says why each failed)."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    if not prebuilt:
        return _compile_and_load()
    try:
        lib, level = load_prebuilt(pathlib.Path(prebuilt))
    except Exception as e:  # noqa: BLE001 - any failure: compiled here instead, said
        log.warning("$%s=%s not loaded (%s): compiling the step here", PREBUILT_ENV, prebuilt, e)
        try:
            return _compile_and_load()
        except NativeBuildError as failed:
            raise NativeBuildError(f"{failed}; ${PREBUILT_ENV}: {e}") from failed
    log.info("CPU LSTM: the steps built ahead of time for %s (%s)", level, prebuilt)
    return lib


def _compile_and_load() -> ctypes.CDLL:
    """The compiled step's library, built now unless cached (NativeBuildError if not)."""
    compiler = _compiler()
    identity = cpu_identity()
    build_flags = flags(identity)
    try:
        said = (" ".join((*compiler[1:], *build_flags)), _compiler_version(compiler), identity)
        parts = (SOURCE.read_bytes(), *(text.encode() for text in said))
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:32]
        directory, temporary = cache_dir()
        try:
            library = _build(directory, compiler, build_flags, key)
            if not _private(library, stat.S_ISREG):
                raise NativeBuildError(
                    f"{library} is not a private file of this user: not loaded (delete it, "
                    "and the server builds it again)"
                )
            try:
                lib = ctypes.CDLL(str(library))
            except OSError as e:  # a cached file cut short, say: built again, once
                log.warning("cached %s failed to load (%s): building it again", library, e)
                os.unlink(library)
                lib = ctypes.CDLL(str(_build(directory, compiler, build_flags, key)))
        finally:
            if temporary:  # a loaded library stays mapped without its file
                shutil.rmtree(directory, ignore_errors=True)
    except (OSError, UnicodeError) as e:
        raise NativeBuildError(f"{type(e).__name__}: {e}") from e
    _declare(lib)
    return lib


# --- libraries built ahead of time ------------------------------------------------------

#: A directory of libraries built ahead of time (``prebuild``), loaded from instead of
#: compiling where set.
PREBUILT_ENV = "GRADSERVE_NATIVE_DIR"
MANIFEST = "manifest.json"
#: x86-64's micro-architecture levels (the psABI's), best first, each with the
#: ``/proc/cpuinfo`` flags it adds to the levels after it (``abm``: LZCNT).
X86_64_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64-v4", frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})),
    ("x86-64-v3", frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe",
                             "xsave"})),
    ("x86-64-v2", frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})),
    ("x86-64", frozenset()),
)  # fmt: skip
#: The one level built on other architectures: the compiler's default target.
BASELINE = "baseline"


def _x86_64(machine: str) -> bool:
    return machine in ("x86_64", "AMD64")


def levels(machine: str | None = None) -> tuple[str, ...]:
    """The levels built ahead of time for ``machine`` (default: this one), best first."""
    if _x86_64(machine or platform.machine()):
        return tuple(name for name, _ in X86_64_LEVELS)
    return (BASELINE,)


def level_flags(level: str) -> tuple[str, ...]:
    """The compiler's flags for ``level``: ``FLAGS`` for that target, not this CPU."""
    portable = tuple(f for f in FLAGS if f != "-march=native")
    return portable if level == BASELINE else (*portable, f"-march={level}")


def runnable_levels(cpuinfo: str | None = None, machine: str | None = None) -> tuple[str, ...]:
    """The levels this CPU runs, best first (``cpuinfo``: the text of ``/proc/cpuinfo``,
    read here when None). Every CPU's flags count (a level runs where all of them
    have its flags); where none can be read, x86-64's baseline only."""
    if not _x86_64(machine or platform.machine()):
        return (BASELINE,)
    if cpuinfo is None:
        cpuinfo = _cpuinfo()
    per_cpu = [
        set(value.split())
        for key, _, value in (line.partition(":") for line in cpuinfo.splitlines())
        if key.strip() == "flags"
    ]
    have = set.intersection(*per_cpu) if per_cpu else set()
    runs: list[str] = []
    needed: set[str] = set()
    for name, adds in reversed(X86_64_LEVELS):
        needed |= adds
        if not needed <= have:
            break
        runs.append(name)
    return tuple(reversed(runs))


def _source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def prebuild(directory: pathlib.Path) -> dict[str, Any]:
    """Build every level's library into ``directory`` (made if missing; one that exists
    must be owned by this user or root and writable by no one else) with this host's
    compiler, for CPUs other than this one, and its manifest (returned) last, with each
    library's SHA-256: a reader never finds a manifest naming a library not yet there,
    and a rebuild cut short leaves libraries the old manifest does not vouch for.
    Temporaries are made exclusively (a link planted in the directory is never written
    through). Files are made readable by all (the server may run as another user) and
    writable by none but their owner."""
    compiler = _compiler()
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    directory = directory.resolve(strict=True)  # (a link to it: what it names is checked)
    if not _trusted(directory):
        raise NativeBuildError(
            f"{directory} is not a directory of this user or root only: not built into"
        )
    libraries: dict[str, dict[str, str]] = {}
    for level in levels():
        name = f"lstm_cpu_step-{level}.so"
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=directory)
        os.close(fd)
        try:
            done = _run(
                [*compiler, *level_flags(level), str(SOURCE), "-lm", "-o", tmp],
                COMPILE_TIMEOUT_SECONDS,
            )
            if done.returncode != 0:
                raise NativeBuildError(
                    f"{compiler[0]} failed for {level}: {done.stderr.strip()[-2000:]}"
                )
            os.chmod(tmp, 0o755)
            digest = hashlib.sha256(pathlib.Path(tmp).read_bytes()).hexdigest()
            os.replace(tmp, directory / name)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        libraries[level] = {"file": name, "sha256": digest}
    manifest = {
        "source_sha256": _source_digest(),
        "machine": platform.machine(),
        "compiler": " ".join(compiler),
        "compiler_version": _compiler_version(compiler).strip().splitlines()[0],
        "libraries": libraries,
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}-", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o644)
            out.write(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, directory / MANIFEST)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return manifest


def _trusted_owners() -> tuple[int, ...]:
    """Who may own what is loaded ahead of time: root (an image's) or this user."""
    return (0, os.getuid())


def _trusted(path: pathlib.Path, is_kind: Callable[[int], bool] = stat.S_ISDIR) -> bool:
    """``path`` is root's or this user's only (``prebuild``'s directory)."""
    return _path_only_theirs(path, is_kind, _trusted_owners())


def _open_trusted(name: str, dir_fd: int | None, is_kind: Callable[[int], bool], flags: int) -> int:
    """``name`` (in the directory ``dir_fd``), opened with ``flags`` and checked as
    what was opened (``fstat``: no other file can be swapped in after the check);
    NativeBuildError where it is missing or not root's or this user's only."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | flags, dir_fd=dir_fd)
    except OSError as e:
        raise NativeBuildError(f"{name}: {e.strerror or e}") from e
    try:
        if not _only_theirs(os.fstat(fd), is_kind, _trusted_owners()):
            raise NativeBuildError(
                f"{name} is not owned by root or this user, or others can write it"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_prebuilt(directory: pathlib.Path, cpuinfo: str | None = None) -> tuple[ctypes.CDLL, str]:
    """The best library of ``directory`` (``prebuild``'s) this CPU runs, loaded, and
    its level; NativeBuildError where there is none to trust: a directory, manifest
    or library someone else could write, a library whose bytes the manifest does not
    name, a manifest of another source or machine. Everything is read through file
    descriptors checked as opened (the directory's, then the files' in it), and the
    library loaded from its descriptor: a path swapped between the check and the load
    (a parent directory others can write) finds nothing to swap."""
    try:
        # (a link to the directory is followed: what it opened is what is checked)
        dir_fd = _open_trusted(str(directory), None, stat.S_ISDIR, os.O_DIRECTORY)
    except NativeBuildError as e:
        raise NativeBuildError(f"the directory {e}") from None
    try:
        try:
            manifest_fd = _open_trusted(MANIFEST, dir_fd, stat.S_ISREG, os.O_NOFOLLOW)
            with os.fdopen(manifest_fd, "rb") as f:
                manifest = json.loads(f.read(1 << 20))
            libraries, digest, machine = (
                manifest["libraries"], manifest["source_sha256"], manifest["machine"]
            )  # fmt: skip
            files = {
                str(lv): (str(lib["file"]), str(lib["sha256"])) for lv, lib in libraries.items()
            }
        except NativeBuildError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise NativeBuildError(f"{MANIFEST} unreadable: {type(e).__name__}: {e}") from e
        if digest != _source_digest() or machine != platform.machine():
            raise NativeBuildError(
                f"{directory} was built from another {SOURCE.name} or for another machine "
                f"({machine}): build it again (python -m gradserve.kernels.native {directory})"
            )
        level = next((lv for lv in runnable_levels(cpuinfo) if lv in files), None)
        if level is None:
            raise NativeBuildError(
                f"{directory} has no library this CPU runs (has {sorted(files)})"
            )
        name, want = files[level]
        if pathlib.PurePath(name).name != name or "\0" in name:
            raise NativeBuildError(f"{name!r} is not a file name in {directory}")
        lib_fd = _open_trusted(name, dir_fd, stat.S_ISREG, os.O_NOFOLLOW)
    finally:
        os.close(dir_fd)
    loaded = False
    try:
        with os.fdopen(os.dup(lib_fd), "rb") as f:
            got = hashlib.file_digest(f, "sha256").hexdigest()
        if got != want:
            raise NativeBuildError(f"{name}'s bytes are not those its manifest names")
        # Loaded from the descriptor checked and hashed, kept open for good once
        # loaded (even if declaring it fails): dlopen knows a loaded library by its
        # path, and a number closed and reused would find this one again.
        try:
            lib = ctypes.CDLL(f"/proc/self/fd/{lib_fd}")
        except OSError as e:
            raise NativeBuildError(f"{name} failed to load (/proc mounted?): {e}") from e
        loaded = True
        try:
            _declare(lib)
        except AttributeError as e:
            raise NativeBuildError(f"{name} lacks the steps' functions: {e}") from e
    finally:
        if not loaded:
            os.close(lib_fd)
    return lib, level


def main(argv: list[str] | None = None) -> int:
    """``python -m gradserve.kernels.native DIR``: ``prebuild`` into DIR (an image's
    build stage with a compiler; the server then runs with ``$GRADSERVE_NATIVE_DIR``)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m gradserve.kernels.native",
        description="Build the CPU LSTM's compiled steps ahead of time, for every level "
        "of this architecture, into DIR (then serve with GRADSERVE_NATIVE_DIR=DIR).",
    )
    parser.add_argument("directory", metavar="DIR")
    args = parser.parse_args(argv)
    try:
        manifest = prebuild(pathlib.Path(args.directory))
    except (NativeBuildError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(manifest, indent=2))
    return 0


def _declare(lib: ctypes.CDLL) -> None:
    ptr, long_, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    step = getattr(lib, STEP)
    step.argtypes = [ptr, long_, ptr, long_, ptr, ptr, ptr, *[long_] * 6, f32, *[ptr] * 7]
    step.restype = None
    for name in (TANH, TANH_FMA):
        tanh = getattr(lib, name)
        tanh.argtypes = [ptr, ptr, long_]
        tanh.restype = None
    packed_floats = getattr(lib, PACKED_FLOATS)
    packed_floats.argtypes = [long_, long_]
    packed_floats.restype = long_
    pack = getattr(lib, PACK)
    pack.argtypes = [ptr, long_, long_, *[long_] * 4, ptr]  # w, rows, units, offsets; packed
    pack.restype = None
    fused = getattr(lib, FUSED_STEPS)
    # team, steps, h0, c0, packed, proj, proj_stride, bias, peep; batch, units, the four
    # offsets; cell_clip; the seven outputs
    fused.argtypes = [ptr, long_, ptr, ptr, ptr, ptr, long_, ptr, ptr, *[long_] * 6, f32,
                      *[ptr] * 7]  # fmt: skip
    fused.restype = None
    packed_t_floats = getattr(lib, PACKED_T_FLOATS)
    packed_t_floats.argtypes = [long_]
    packed_t_floats.restype = long_
    pack_t = getattr(lib, PACK_T)
    pack_t.argtypes = [ptr, long_, ptr]  # w_h, units; packed
    pack_t.restype = None
    backward_fused = getattr(lib, BACKWARD_FUSED_STEP)
    # team, dgates_next, packed, i, f, o, ci, co, cs, cs_last, h_grad, cs_grad, peep;
    # clip, clip_at; batch, units, the four offsets; dcs, dgates, dh
    backward_fused.argtypes = [*[ptr] * 13, ctypes.c_int, f32, *[long_] * 6, ptr, ptr, ptr]
    backward_fused.restype = None
    backward_steps = getattr(lib, BACKWARD_FUSED_STEPS)
    # team, t_from, steps, packed, i, f, o, ci, co, cs, cs_prev, h_grad, cs_grad, peep;
    # clip, clip_at; batch, units, the four offsets; dcs, dgates
    backward_steps.argtypes = [ptr, long_, long_, *[ptr] * 11, ctypes.c_int, f32,
                               *[long_] * 6, ptr, ptr]  # fmt: skip
    backward_steps.restype = None
    flush = getattr(lib, FLUSH)
    flush.argtypes = []
    flush.restype = ctypes.c_ulong
    restore = getattr(lib, RESTORE)
    restore.argtypes = [ctypes.c_ulong]
    restore.restype = None
    any_subnormal = getattr(lib, ANY_SUBNORMAL)
    any_subnormal.argtypes = [ptr, long_]
    any_subnormal.restype = ctypes.c_int
    for name in (CLAIMS, BACKWARD_CLAIMS):
        claims = getattr(lib, name)
        claims.argtypes = [long_, long_]
        claims.restype = long_
    team_start = getattr(lib, TEAM_START)
    team_start.argtypes = [long_]
    team_start.restype = ptr
    team_stop = getattr(lib, TEAM_STOP)
    team_stop.argtypes = [ptr]
    team_stop.restype = None
    for name, real in ((BACKWARD_F32, ctypes.c_float), (BACKWARD_F64, ctypes.c_double)):
        backward = getattr(lib, name)
        # dh, dcs, i, f, o, ci, co, cs, cs_last, h_grad, cs_grad, peep; clip, clip_at;
        # batch, units, the four offsets; dgates
        backward.argtypes = [*[ptr] * 12, ctypes.c_int, real, *[long_] * 6, ptr]
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
                    log.info("CPU LSTM: the compiled elementwise step (%s)", SOURCE.name)
                except Exception as e:  # noqa: BLE001 - any failure: NumPy's pass, said once
                    self._failure = str(e) if isinstance(e, NativeBuildError) else repr(e)
                    log.warning("CPU LSTM: NumPy's elementwise passes (%s)", self._failure)
            return self._lib

    @property
    def failure(self) -> str | None:
        """Why the build failed (None: it did not, or none was tried)."""
        return self._failure


NATIVE = NativeStep()


def _built() -> ctypes.CDLL:
    lib = NATIVE.library()
    if lib is None:
        raise NativeBuildError(NATIVE.failure or "not built")
    return lib


def packed_floats(rows: int, units: int) -> int:
    """The floats of a [rows, 4 units] weight matrix packed for the FUSED formulation's
    step (W_h: ``units`` rows)."""
    return int(getattr(_built(), PACKED_FLOATS)(rows, units))


def pack(w: Any, offsets: tuple[int, int, int, int], out: Any) -> None:
    """``w`` ([rows, 4 units] float32, C-contiguous; the i, f, c, o columns at
    ``offsets``) packed into ``out`` (``packed_floats(rows, units)`` float32) for
    ``fused_step``."""
    rows, columns = w.shape
    units = columns // 4
    if (
        columns != 4 * units or not w.flags.c_contiguous or not out.flags.c_contiguous
        or out.shape != (packed_floats(rows, units),)
        or w.dtype.str != "<f4" or out.dtype.str != "<f4"
    ):  # fmt: skip
        raise ValueError(f"pack: weights {w.shape} {w.dtype} into {out.shape} {out.dtype}")
    getattr(_built(), PACK)(w.ctypes.data, rows, units, *offsets, out.ctypes.data)


def packed_transposed_floats(units: int) -> int:
    """The floats of W_h^T ([4 units, units]) packed for ``backward_fused_step``."""
    return int(getattr(_built(), PACKED_T_FLOATS)(units))


def pack_transposed(w_h: Any, out: Any) -> None:
    """W_h ([units, 4 units] float32, C-contiguous) transposed and packed into ``out``
    (``packed_transposed_floats(units)`` float32) for ``backward_fused_step``."""
    units, columns = w_h.shape
    if (
        columns != 4 * units or not w_h.flags.c_contiguous or not out.flags.c_contiguous
        or out.shape != (packed_transposed_floats(units),)
        or w_h.dtype.str != "<f4" or out.dtype.str != "<f4"
    ):  # fmt: skip
        raise ValueError(f"pack_transposed: W_h {w_h.shape} {w_h.dtype} into {out.shape}")
    getattr(_built(), PACK_T)(w_h.ctypes.data, units, out.ctypes.data)


def backward_fused_steps() -> Callable[..., None]:
    """FUSED's backward steps, several a call (``lstm_cpu_step.c`` states its
    arguments; the first is a team of ``FusedTeams.team`` or None)."""
    return getattr(_built(), BACKWARD_FUSED_STEPS)  # type: ignore[no-any-return]


def backward_fused_step() -> Callable[..., None]:
    """FUSED's backward step (``lstm_cpu_step.c`` states its arguments; the first is a
    team of ``FusedTeams.team`` or None)."""
    return getattr(_built(), BACKWARD_FUSED_STEP)  # type: ignore[no-any-return]


@contextlib.contextmanager
def flushing_subnormals() -> Iterator[None]:
    """This thread computes with subnormal floats read and written as zero in the block
    (flush-to-zero and denormals-are-zero, as TensorFlow's CPU kernels: a FUSED call;
    ``lstm_cpu_step.c`` says why), its mode as it was after it."""
    lib = _built()
    was = getattr(lib, FLUSH)()
    try:
        yield
    finally:
        getattr(lib, RESTORE)(was)


def any_subnormal(a: Any) -> bool:
    """Whether the C-contiguous float32 array ``a`` holds a subnormal float."""
    if a.dtype.str != "<f4" or not a.flags.c_contiguous:
        raise ValueError(f"any_subnormal: {a.shape} {a.dtype}, not C-contiguous float32")
    return bool(getattr(_built(), ANY_SUBNORMAL)(a.ctypes.data, a.size))


def step_claims(batch: int, units: int, backward: bool = False) -> int:
    """The claims a team's members take of a FUSED step of that shape, forward or
    ``backward`` (at most that many members have work)."""
    return int(getattr(_built(), BACKWARD_CLAIMS if backward else CLAIMS)(batch, units))


def fused_steps() -> Callable[..., None]:
    """The FUSED formulation's steps, several a call (``lstm_cpu_step.c`` states its
    arguments; the first is a team of ``fused_team`` or None)."""
    return getattr(_built(), FUSED_STEPS)  # type: ignore[no-any-return]


class FusedTeams:
    """Teams of threads for ``fused_steps``, kept between calls: a team of ``threads``
    is the caller and ``threads - 1`` workers, which sleep while no step comes. Teams
    started per call ran a call at two threads in 6.9 ms or, about every other call,
    in 10-13 (at (50, 32, 256)): the scheduler put a fresh worker on the core of the
    caller (whose steps then waited for it); kept workers stay where they ran.

    A team serves one call at a time (``team``); at most ``KEEP`` idle ones of each
    size are kept, the rest stopped. A forked child forgets its parent's teams (their
    workers are not in it) and starts its own."""

    KEEP = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[int, list[int]] = {}
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._idle = {}

    @contextlib.contextmanager
    def team(self, threads: int) -> Iterator[int | None]:
        """A team of ``threads`` for the block, or None for the caller alone (one
        thread, or no worker could be started)."""
        if threads < 2:
            yield None
            return
        lib = _built()
        with self._lock:
            idle = self._idle.setdefault(threads, [])
            team = idle.pop() if idle else None
        if team is None:
            team = getattr(lib, TEAM_START)(threads)
        try:
            yield team
        finally:
            if team is not None:
                with self._lock:
                    idle = self._idle.setdefault(threads, [])
                    keep = len(idle) < self.KEEP
                    if keep:
                        idle.append(team)
                if not keep:
                    getattr(lib, TEAM_STOP)(team)


TEAMS = FusedTeams()


if __name__ == "__main__":
    sys.exit(main())
