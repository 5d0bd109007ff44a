"""Small value types the SDK hands out: resident tensor refs, TensorArray handles."""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from gradserve.client._client import Client


class TensorArrayHandle(NamedTuple):
    """A TensorArray in the session: ``id`` is the key, ``name`` TensorFlow's name."""

    id: str
    name: str


class TensorRef:
    """A tensor held in the session; usable anywhere an array is accepted.

    ``numpy()`` fetches it; ``delete()`` frees it on the server.
    """

    __slots__ = ("id", "dtype", "shape", "_client")

    def __init__(self, client: Client, tensor_id: str, dtype: np.dtype, shape: tuple[int, ...]):
        self.id = tensor_id
        self.dtype = dtype
        self.shape = shape
        self._client = client

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # not np.prod: 10 us a call

    def numpy(self) -> Any:
        """The tensor's value, as TensorFlow's ``.numpy()`` gives it: an array, a 0-d
        one as a NumPy scalar (a string one as ``bytes``)."""
        value = self._client.get(self)
        return value[()] if value.ndim == 0 else value

    def delete(self) -> None:
        self._client.delete(self)

    def __repr__(self) -> str:
        return f"TensorRef(id={self.id[:8]}…, dtype={self.dtype}, shape={self.shape})"


#: The tapes an output belongs to: each weakly (an output keeps no tape alive, as in
#: TensorFlow), with the id it had when the output was recorded: a non-persistent tape
#: entered again after its gradient call records under a new id, and the outputs of
#: its last recording are no longer its own.
TapeRefs = tuple[tuple[weakref.ref[Any], str], ...]


def tape_refs(tapes: Any) -> TapeRefs:
    """``TapeRefs`` for ``tapes`` as they are now: tapes (entered: they have ids), or
    tapes in a recording of theirs (``_tape.Recorded``, a batch step's: its ``tape``
    and that recording's id)."""
    return tuple((weakref.ref(getattr(t, "tape", t)), t.id) for t in tapes)


class TapedArray(np.ndarray):
    """An op output computed under a gradient tape: the value, plus the id by which
    the tape holds it (``tape_id``).

    It is a NumPy array in every respect; passed to another op while its tape is
    alive, the SDK sends the id instead of the value, so the tape sees the same
    tensor flow on (as a ``tf.Tensor`` does) and the value does not travel back.
    Arrays computed from it locally are plain values (the id is not inherited). It is
    read-only, as a ``tf.Tensor`` is (``np.array(a)`` gives a writable copy).
    """

    tape_id: str | None = None
    #: Weak references to the tapes that recorded it: an output keeps no tape alive
    #: (as in TensorFlow), so a tape the program dropped is released even while its
    #: outputs, or slices of them, are kept (``GradientTape``'s finalizer).
    _tapes: TapeRefs = ()

    @classmethod
    def wrap(cls, value: np.ndarray, tape_id: str, tapes: TapeRefs) -> TapedArray:
        out = np.asarray(value).view(cls)
        out.tape_id = tape_id
        out._tapes = tapes
        # Read-only, as a tf.Tensor: changed in place, it would still be sent by id,
        # and the server would use the value the tape holds. ``np.array(a)`` copies.
        out.flags.writeable = False
        return out

    def __array_finalize__(self, obj: Any) -> None:
        # Views, slices and results of arithmetic are new values: no tape id.
        self.tape_id = None
        self._tapes = ()

    def __reduce__(self) -> Any:  # pickles as a plain array
        return np.asarray(self).__reduce__()

    def live_tapes(self) -> list[Any]:
        """The tapes that recorded it and are still alive (unreleased or not)."""
        live = ((ref(), tape_id) for ref, tape_id in self._tapes)
        return [tape for tape, tape_id in live if tape is not None and tape.id == tape_id]

    @property
    def held(self) -> bool:
        """True while a tape that recorded it still holds it on the server."""
        return self.tape_id is not None and any(not t.released for t in self.live_tapes())


class StepOutput(NamedTuple):
    """In a ``client.batch()``: output ``field`` of the batch's step ``step``, usable
    as an input of a later step of the same batch (it never crosses the wire).

    ``dtype`` is the output's dtype where the SDK knows it when recording (the value
    of a TensorArray read, gather or concat, an LSTM op's outputs, StopGradient's),
    else None: an LSTM step that takes it sets ``T`` from it and converts its other
    inputs to it, as TensorFlow does with a tensor (found by a review helper: a
    float16 gathered ``x`` next to float64 arrays was refused).

    ``batch`` numbers the batch that made it: another batch's step, or a direct call,
    refuses it (a review helper: batch A's placeholder named batch B's step of that
    index, silently); None (one made by hand) is taken as the batch's own."""

    step: int
    field: str
    dtype: np.dtype | None = None
    batch: int | None = None
