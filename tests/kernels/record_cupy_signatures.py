"""Record what real CuPy offers under every name the stand-in ``cupy`` offers, and how it
refuses host arrays, into ``cupy_signatures.json``: the conformance test
(``test_fake_cupy_conformance.py``) compares the stand-in against that file where CuPy
is not installed, and against CuPy itself where it is.

Run it again whenever the stand-in gains a name (the test says so), with an
installed CuPy; importing CuPy needs no GPU, nor does anything recorded here::

    python3 -m venv /tmp/cupyvenv
    /tmp/cupyvenv/bin/pip install cupy-cuda13x numpy
    /tmp/cupyvenv/bin/python tests/kernels/record_cupy_signatures.py

It needs only NumPy and CuPy (not pytest, nor gradserve's dependencies).

Per name: its kind ("class", "callable", "attribute" for a property or other data
descriptor, "data" for anything else, "missing") and, for classes and callables,
the parameters of its signature (name, kind, whether it has a default) as Python
reports them, or as the first line of a Cython docstring states them; None where
neither tells. Per refusal (``REFUSALS``): the exception CuPy raises, and its message.
"""

from __future__ import annotations

import inspect
import json
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from tests.kernels import fake_cupy  # noqa: E402

RECORDING = pathlib.Path(__file__).with_name("cupy_signatures.json")
#: What the stand-in offers tests only (its call logs).
TEST_ONLY = {"compiled", "lookups", "transfers", "returned_stand_ins"}
#: Dunder members that are part of an API (the rest are Python's plumbing; a
#: class's constructor is checked as the class itself).
API_DUNDERS = {
    "__array__",
    "__call__",
    "__cuda_array_interface__",
    "__enter__",
    "__exit__",
    "__version__",
}
#: Marks a stand-in that calls return (a RawKernel, the default pool): code never builds
#: one, so its members are checked and its constructor is not.
RETURNED = " (returned)"
#: A parameter's default, where only its existence is known (a docstring's).
HAS_DEFAULT = object()


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
                    name, kind, default=HAS_DEFAULT if default else inspect.Parameter.empty
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


def describe(obj) -> dict:
    """What the conformance test compares of one CuPy object (``MISSING`` for none)."""
    if obj is MISSING:
        return {"kind": "missing"}
    if isinstance(obj, type):
        kind = "class"
    elif inspect.isdatadescriptor(obj):
        return {"kind": "attribute"}
    elif callable(obj):
        kind = "callable"
    else:
        return {"kind": "data"}
    sig = signature_of(obj)
    parameters = None
    if sig is not None:
        parameters = [
            [p.name, p.kind.name, p.default is not inspect.Parameter.empty]
            for p in sig.parameters.values()
        ]
    return {"kind": kind, "parameters": parameters}


def signature_from_record(record: dict) -> inspect.Signature | None:
    """The signature ``describe`` recorded (defaults known only to exist)."""
    if record.get("parameters") is None:
        return None
    return inspect.Signature(
        [
            inspect.Parameter(
                name,
                getattr(inspect.Parameter, kind),
                default=HAS_DEFAULT if has_default else inspect.Parameter.empty,
            )
            for name, kind, has_default in record["parameters"]
        ]
    )


# ------------------------------------------------------------------ the stand-in's names
MISSING = object()


def stand_in_names(fake) -> list[tuple[str, Any, tuple[str, ...]]]:
    """(dotted name, stand-in object, attribute path in CuPy) for every name the
    stand-in ``fake`` offers, the members of its classes, and the stand-ins calls return."""
    names = []

    def public(name: str) -> bool:
        return name not in TEST_ONLY and (not name.startswith("_") or name in API_DUNDERS)

    def walk(prefix: str, path: tuple[str, ...], namespace) -> None:
        for name, value in vars(namespace).items():
            if not public(name):
                continue
            names.append((f"{prefix}{name}", value, (*path, name)))
            if isinstance(value, type):
                members(f"{prefix}{name}", (*path, name), value)
            elif not callable(value) and hasattr(value, "__dict__"):  # a namespace
                walk(f"{prefix}{name}.", (*path, name), value)

    def members(dotted: str, path: tuple[str, ...], cls: type) -> None:
        for name, value in vars(cls).items():
            if public(name):
                names.append((f"{dotted}.{name}", value, (*path, name)))

    walk("cupy.", (), fake)
    for dotted, cls in fake.returned_stand_ins:
        path = tuple(dotted.split("."))
        names.append((f"cupy.{dotted}{RETURNED}", cls, path))
        members(f"cupy.{dotted}{RETURNED}", path, cls)
    return names


def lookup(cupy, path: tuple[str, ...]):
    """``cupy.<path>``, or MISSING."""
    obj = cupy
    for part in path:
        obj = getattr(obj, part, MISSING)
        if obj is MISSING:
            break
    return obj


# ------------------------------------------------------------------ refusals
def uninitialised(cupy):
    """A device array of ``cupy`` for the refusals: real CuPy's without device memory
    (so no GPU is needed: each refusal happens before memory is touched), the
    stand-in's a 0-d array."""
    if cupy.ndarray is fake_cupy.DeviceArray:
        return cupy.zeros(())
    return cupy.ndarray.__new__(cupy.ndarray, _no_init=True)


#: Host arrays handed to the device where CuPy wants device arrays (or scalars), each
#: with ``(cupy, device_array)``. ``check`` says what the test compares: the exception's
#: type and message, or its type only (the message names the class).
REFUSALS: dict[str, tuple[Callable[[Any, Any], object], str]] = {
    "np.asarray(device)": (lambda cupy, d: np.asarray(d), "message"),
    "np.ascontiguousarray(device)": (lambda cupy, d: np.ascontiguousarray(d), "message"),
    "device.__array__()": (lambda cupy, d: d.__array__(), "message"),
    "device.__array_interface__": (lambda cupy, d: d.__array_interface__, "type"),
    "device.ctypes": (lambda cupy, d: d.ctypes, "type"),
    "hash(device)": (lambda cupy, d: hash(d), "type"),
    "device.set(list)": (lambda cupy, d: d.set([1.0]), "message"),
    "device.fill(host array)": (lambda cupy, d: d.fill(np.ones(3)), "message"),
    "cupy.matmul(device, host)": (lambda cupy, d: cupy.matmul(d, np.ones((2, 2))), "message"),
    "cupy.matmul(host, device)": (lambda cupy, d: cupy.matmul(np.ones((2, 2)), d), "message"),
    "device @ host": (lambda cupy, d: d @ np.ones((2, 2)), "message"),
    "cupy.ascontiguousarray(host)": (lambda cupy, d: cupy.ascontiguousarray(np.ones(2)), "message"),
    "cupy.copyto(device, host)": (lambda cupy, d: cupy.copyto(d, np.ones(3)), "message"),
}


def refusal(cupy, name: str) -> dict:
    """How ``cupy`` answers ``REFUSALS[name]``: the exception raised, or what it returned."""
    probe, _ = REFUSALS[name]
    try:
        result = probe(cupy, uninitialised(cupy))
    except Exception as exc:  # noqa: BLE001 - recorded
        return {"raises": type(exc).__name__, "message": str(exc)}
    return {"returns": type(result).__name__}


# ------------------------------------------------------------------ the recording
def record(cupy) -> dict:
    fake = fake_cupy.make_fake_cupy(shim_lib=None)
    return {
        "cupy": cupy.__version__,
        "numpy": np.__version__,
        "names": {d: describe(lookup(cupy, path)) for d, _, path in stand_in_names(fake)},
        "refusals": {name: refusal(cupy, name) for name in REFUSALS},
    }


def load() -> dict:
    return json.loads(RECORDING.read_text())


def main() -> None:
    import cupy

    text = json.dumps(record(cupy), indent=1, sort_keys=True)
    # One line per parameter: [name, kind, has a default].
    text = re.sub(r'\[\s+("[^"]*"),\s+("[A-Z_]+"),\s+(true|false)\s+\]', r"[\1, \2, \3]", text)
    RECORDING.write_text(text + "\n")
    print(f"recorded CuPy {cupy.__version__} into {RECORDING}")


if __name__ == "__main__":
    main()
