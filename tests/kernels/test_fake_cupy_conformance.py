"""The stand-in ``cupy`` (``fake_cupy``) accepts nothing that real CuPy refuses.

CI runs the CUDA backend's Python code against the stand-in; that only proves
the backend right for CuPy if the stand-in is no looser than CuPy: every name
the stand-in offers exists in CuPy, and every function or method it defines
takes its parameters under CuPy's names and kinds (a parameter the stand-in
takes by position CuPy takes at the same position; one the stand-in lets a call
omit has a default in CuPy; CuPy requires nothing the stand-in does not).

The comparison needs CuPy installed (the ``cuda`` extra; importing it needs no
GPU): it runs in ``make gpu-check`` and wherever the extra is installed, and is
skipped elsewhere. The check's own logic, and that the stand-in offers every
name the CUDA code uses, are tested everywhere.
"""

from __future__ import annotations

import inspect
import re

import pytest

from tests.kernels import fake_cupy

#: What the stand-in offers tests only (its call logs).
TEST_ONLY = {"compiled", "lookups", "transfers", "returned_stand_ins"}
#: Dunder members that are part of an API (the rest are Python's plumbing; a
#: class's constructor is checked as the class itself).
API_DUNDERS = {"__call__", "__enter__", "__exit__", "__cuda_array_interface__", "__version__"}
#: Classes the CUDA code names only as types, never constructs (their members are checked).
USED_AS_TYPES = {"cupy.ndarray"}
#: Marks a stand-in that calls return (a RawKernel, the default pool): code never builds
#: one, so its members are checked and its constructor is not.
RETURNED = " (returned)"
_HAS_DEFAULT = object()


# ------------------------------------------------------------------ signatures
def parse_doc_signature(doc: str) -> inspect.Signature:
    """The signature on the first line of a Cython docstring, e.g.
    ``RawModule(str code=None, *, tuple options=(), name_expressions=None)`` or
    ``_BaseStream.begin_capture(self, mode=None) -> Graph``."""
    match = re.match(r"[\w.]+\((.*)\)\s*(->.*)?$", doc.strip().splitlines()[0])
    assert match, f"no signature in docstring {doc[:80]!r}"
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for token in _split_top_level(match.group(1)):
        if token == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
        elif token.startswith("**"):
            params.append(inspect.Parameter(token[2:], inspect.Parameter.VAR_KEYWORD))
        elif token.startswith("*"):
            params.append(inspect.Parameter(token[1:], inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
        else:
            declared, _, default = token.partition("=")
            name = declared.split()[-1]  # "str code" -> "code"
            params.append(
                inspect.Parameter(
                    name, kind, default=_HAS_DEFAULT if default else inspect.Parameter.empty
                )
            )
    return inspect.Signature(params)


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [p for p in [*parts, current.strip()] if p]


def signature_of(obj) -> inspect.Signature | None:
    """Python's signature, else the docstring's; ``self`` dropped."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        doc = getattr(obj, "__doc__", None)
        if not doc or "(" not in doc.splitlines()[0]:
            return None
        sig = parse_doc_signature(doc)
    params = list(sig.parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return sig.replace(parameters=params)


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
_MISSING = object()


def stand_in_pairs(cupy) -> list[tuple[str, object, object]]:
    """(dotted name, stand-in object, CuPy object or _MISSING) for every name the
    stand-in offers, the members of its classes, and the stand-ins calls return."""
    fake = fake_cupy.make_fake_cupy(shim_lib=None)
    pairs = []

    def public(name: str) -> bool:
        return name not in TEST_ONLY and (not name.startswith("_") or name in API_DUNDERS)

    def walk(prefix, fake_ns, real_ns):
        for name, value in vars(fake_ns).items():
            if not public(name):
                continue
            dotted = f"{prefix}{name}"
            real_value = getattr(real_ns, name, _MISSING)
            pairs.append((dotted, value, real_value))
            if isinstance(value, type):
                members(dotted, value, real_value)
            elif not callable(value) and hasattr(value, "__dict__"):  # a namespace
                walk(f"{dotted}.", value, real_value)

    def members(dotted, fake_cls, real_cls):
        for name, value in vars(fake_cls).items():
            if public(name):
                pairs.append((f"{dotted}.{name}", value, getattr(real_cls, name, _MISSING)))

    walk("cupy.", fake, cupy)
    for dotted, fake_cls in fake.returned_stand_ins:
        real_cls = cupy
        for part in dotted.split("."):
            real_cls = getattr(real_cls, part, _MISSING)
        pairs.append((f"cupy.{dotted}{RETURNED}", fake_cls, real_cls))
        members(f"cupy.{dotted}{RETURNED}", fake_cls, real_cls)
    return pairs


def looseness(dotted: str, fake, real) -> list[str]:
    if real is _MISSING:
        return ["the stand-in offers it, CuPy does not"]
    if (
        not callable(fake)
        or isinstance(fake, property)
        or dotted in USED_AS_TYPES
        or dotted.endswith(RETURNED)
    ):
        return []  # existing is all there is to it
    fake_sig, real_sig = signature_of(fake), signature_of(real)
    if fake_sig is None:
        return []
    if real_sig is None:
        return ["CuPy's signature is unknown"]
    return incompatibilities(fake_sig, real_sig)


def test_stand_in_is_no_looser_than_cupy():
    cupy = pytest.importorskip("cupy")
    pairs = stand_in_pairs(cupy)
    assert len(pairs) > 30  # the walk reached the classes' members too
    problems = {d: p for d, fake, real in pairs if (p := looseness(d, fake, real))}
    assert problems == {}


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
    offered = {d.removeprefix("cupy.").removesuffix(RETURNED) for d, _, _ in stand_in_pairs(None)}
    assert used <= offered, used - offered
