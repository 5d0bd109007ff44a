"""What a server computes with: the array backend of its device, and how a whole
LSTM call runs on it (the eager per-step loop, or replayed CUDA graphs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gradserve.kernels import blas_threads, lstm, lstm_cpu, native
from gradserve.kernels.backends import get_backend

if TYPE_CHECKING:
    from gradserve.kernels.cuda_graphs import GraphCache


class Compute:
    """The device's backend (``xp``, ``to_host``, the fused steps) plus the LSTM runner."""

    def __init__(
        self,
        backend: Any,
        graphs: GraphCache | None = None,
        empty: lstm.Empty | None = None,
        blas: blas_threads.BlasThreads | None = None,
        formulation: lstm_cpu.Formulation | None = None,
        step_kernel: native.Mode = native.Mode.AUTO,
    ) -> None:
        self.backend = backend
        #: A ``cuda_graphs.GraphCache``, or None for the eager loop.
        self.graphs = graphs
        #: Allocates the eager LSTM's outputs and scratch (None: ``xp.empty``): on the
        #: CPU, the server's warm buffers, so a large call does not fault in fresh pages.
        self.empty = empty
        #: On the CPU, the process's BLAS threads, divided among the LSTM ops computing
        #: at once (None: each op uses the count as it is).
        self.blas = blas
        #: On the CPU, the forward's GEMM formulation for every shape (None: measured
        #: per shape, ``lstm_cpu.Planner``).
        self.formulation = formulation
        #: On the CPU, the forward's elementwise pass in float32 (``native.Mode``).
        self.step_kernel = step_kernel

    @contextlib.contextmanager
    def _computing(self) -> Iterator[None]:
        """Around an eager LSTM op: its share of the BLAS threads, its formulation and
        elementwise pass."""
        pinned = lstm_cpu.PINNED.set(self.formulation)
        step_kernel = lstm_cpu.STEP_KERNEL.set(self.step_kernel)
        try:
            with contextlib.nullcontext() if self.blas is None else self.blas.share():
                yield
        finally:
            lstm_cpu.STEP_KERNEL.reset(step_kernel)
            lstm_cpu.PINNED.reset(pinned)

    @property
    def name(self) -> str:
        return str(self.backend.name)

    def to_host(self, array: Any) -> Any:
        """``array`` as a NumPy array (a device-to-host copy for GPU arrays)."""
        return self.backend.to_host(array)

    def to_device(self, array: Any) -> Any:
        """``array`` where this device computes (a host-to-device copy for host arrays
        on CUDA; the array itself on the CPU)."""
        return self.backend.to_device(array)

    def pool_bytes(self) -> dict[str, int] | None:
        """The device memory pool's "used" and "held" bytes; None where there is no
        pool (the CPU: NumPy allocates from the process heap)."""
        pool_bytes = getattr(self.backend, "pool_bytes", None)
        return None if pool_bytes is None else pool_bytes()

    def lstm_forward(self, inputs: lstm.LSTMInputs[Any], **attrs: Any) -> lstm.LSTMActivations[Any]:
        """``lstm.block_lstm_forward`` on this device (from a graph where one is kept)."""
        if self.graphs is not None:
            return self.graphs.forward(inputs, **attrs)
        with self._computing():
            result: lstm.LSTMActivations[Any] = lstm.block_lstm_forward(
                self.backend, inputs, empty=self.empty, **attrs
            )
        return result

    def lstm_backward(
        self,
        inputs: lstm.LSTMInputs[Any],
        activations: lstm.LSTMActivations[Any],
        output_grads: lstm.LSTMOutputGrads[Any],
        **attrs: Any,
    ) -> lstm.LSTMGrads[Any]:
        """``lstm.block_lstm_backward`` on this device (from a graph where one is kept)."""
        if self.graphs is not None:
            return self.graphs.backward(inputs, activations, output_grads, **attrs)
        with self._computing():
            result: lstm.LSTMGrads[Any] = lstm.block_lstm_backward(
                self.backend, inputs, activations, output_grads, empty=self.empty, **attrs
            )
        return result


def compute_for(
    device: str,
    *,
    cuda_graphs: bool = False,
    graph_cache_bytes: int | None = None,
    host_empty: lstm.Empty | None = None,
    share_blas_threads: bool = False,
    lstm_formulation: str | None = None,
    cpu_step_kernel: str = native.Mode.AUTO.value,
) -> Compute:
    """The ``Compute`` of a resolved device name ("cpu" or "cuda").

    ``cuda_graphs`` (CUDA only) replays whole LSTM calls as graphs, keeping at most
    ``graph_cache_bytes`` of GPU memory in captured plans. ``host_empty`` allocates
    the CPU LSTM's outputs and scratch (unused on CUDA, whose arrays CuPy's pool keeps).
    ``share_blas_threads`` (CPU only): the LSTM ops computing at once divide the BLAS
    threads (``blas_threads.BLAS``), taking the count they divide now.
    ``lstm_formulation`` (CPU only; a ``lstm_cpu.Formulation`` value): every forward
    computes in it, instead of the formulation measured fastest for its shape.
    ``cpu_step_kernel`` (CPU only; a ``native.Mode`` value): the forward's elementwise
    pass in float32; ``native`` raises ``native.NativeBuildError`` where the compiled
    step cannot be built, and ``auto`` builds it now (NumPy's pass where it cannot).
    ``lstm_formulation`` ``fused`` needs the compiled step as ``native`` does (its
    float32 forwards run in it; other dtypes compute as ``hoisted``).
    """
    backend = get_backend(device)
    if not cuda_graphs:
        if device != "cpu":
            return Compute(backend)
        step_kernel = native.Mode(cpu_step_kernel)
        pinned = None if lstm_formulation is None else lstm_cpu.Formulation(lstm_formulation)
        # the flag that needs the compiled step, if one does
        needs = (
            "--cpu-step-kernel native" if step_kernel is native.Mode.NATIVE
            else "--lstm-formulation fused" if pinned is lstm_cpu.Formulation.FUSED
            else None
        )  # fmt: skip
        if needs is not None and step_kernel is native.Mode.NUMPY:
            raise native.NativeBuildError(f"{needs}: not with --cpu-step-kernel numpy")
        if step_kernel is not native.Mode.NUMPY and native.NATIVE.library() is None:
            if needs is not None:
                raise native.NativeBuildError(f"{needs}: {native.NATIVE.failure or 'not built'}")
        blas = None
        if share_blas_threads:
            blas = blas_threads.BLAS
            blas.start()
        return Compute(
            backend, empty=host_empty, blas=blas, formulation=pinned, step_kernel=step_kernel
        )
    if device != "cuda":
        raise ValueError("CUDA graphs need --device cuda")
    from gradserve.kernels import cuda_graphs as graphs

    cache_bytes = graphs.DEFAULT_CACHE_BYTES if graph_cache_bytes is None else graph_cache_bytes
    capture = graphs.StreamCapture(backend.xp)
    return Compute(backend, graphs.GraphCache(backend, capture, cache_bytes))
