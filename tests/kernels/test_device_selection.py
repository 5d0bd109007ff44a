"""``--device`` resolution: a CuPy that is installed but broken is reported, never a crash."""

from __future__ import annotations

import importlib.abc
import logging
import sys

import pytest

from gradserve.kernels import device


class _BrokenCuPy(importlib.abc.MetaPathFinder):
    """Makes ``import cupy`` raise what CuPy raises when its kernel cache dir is not
    writable (a container user without a home directory)."""

    def find_spec(self, name, path=None, target=None):
        if name == "cupy":
            raise PermissionError(13, "Permission denied", "/home/gradserve")
        return None


@pytest.fixture
def broken_cupy(monkeypatch):
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenCuPy(), *sys.meta_path])


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import raises ImportError


def test_broken_cupy_is_a_reason_not_a_crash(broken_cupy):
    reason = device.cuda_unavailable_reason()
    assert reason.startswith("CuPy failed to import: PermissionError")
    assert "/home/gradserve" in reason
    assert device.cuda_unavailable_reason() is not None


def test_auto_with_broken_cupy_serves_on_cpu_and_says_why(broken_cupy, caplog):
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        assert device.select_device("auto") == "cpu"
    assert "serving on the CPU because CuPy failed to import" in caplog.text


def test_cuda_with_broken_cupy_fails_with_the_reason(broken_cupy):
    with pytest.raises(RuntimeError, match=r"--device cuda: CuPy failed to import.*Permission"):
        device.select_device("cuda")


def test_auto_without_cupy_is_quietly_cpu(no_cupy, caplog):
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        assert device.select_device("auto") == "cpu"
    assert caplog.text == ""
    with pytest.raises(RuntimeError, match="CuPy is not installed"):
        device.select_device("cuda")


def test_cpu_never_looks_for_cupy(broken_cupy):
    assert device.select_device("cpu") == "cpu"


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="expected auto, cpu or cuda"):
        device.select_device("tpu")
