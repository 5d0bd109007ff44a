"""The tf.TensorArray-style layer: client.tensor_array(...)."""

from __future__ import annotations

import numpy as np
import pytest

from gradserve.errors import InvalidArgumentError, OutOfRangeError


def test_write_read_stack_unstack(client):
    ta = client.tensor_array(np.float32, size=3, clear_after_read=False)
    ta = ta.write(0, [1, 2]).write(1, [3, 4]).write(2, [5, 6])
    np.testing.assert_array_equal(ta.read(1), [3, 4])
    np.testing.assert_array_equal(ta.stack(), [[1, 2], [3, 4], [5, 6]])
    other = client.tensor_array("float32", size=2).unstack(np.eye(2, dtype=np.float32))
    np.testing.assert_array_equal(other.gather([1, 0]), [[0, 1], [1, 0]])


def test_split_concat_size_close(client):
    ta = client.tensor_array(np.int32, size=2).split(np.arange(5, dtype=np.int32), [2, 3])
    assert ta.size() == 2
    np.testing.assert_array_equal(ta.concat(), np.arange(5))
    ta.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        ta.size()


def test_grad_same_source_same_array(client):
    ta = client.tensor_array(np.float64, size=2)
    ta.write(0, [1.0]).write(1, [2.0])
    g1 = ta.grad("gradients")
    g2 = ta.grad("gradients")
    g3 = ta.grad("gradients_1")
    assert g1.handle == g2.handle != g3.handle
    assert g1.handle.name.endswith("@gradients")
    g1.write(0, [0.5]).write(0, [0.25])
    np.testing.assert_array_equal(g2.read(0), [0.75])
    np.testing.assert_array_equal(g3.read(1), [0.0])  # soft copy: zeros of the forward shape


def test_stack_of_empty_array_uses_element_shape(client):
    ta = client.tensor_array(np.float32, size=0, element_shape=[3])
    assert ta.stack().shape == (0, 3)


def test_grad_with_shape(client):
    h, flow = client.raw_ops.TensorArrayV3(size=1, dtype=np.float32, element_shape=[2])
    flow = client.raw_ops.TensorArrayWriteV3(h, 0, np.ones(2, np.float32), flow)
    g, gflow = client.raw_ops.TensorArrayGradWithShape(h, flow, [3], "gradients")
    assert client.raw_ops.TensorArrayReadV3(g, 0, gflow, np.float32).shape == (3, 2)


F32 = np.float32


def test_written_shapes_are_inferred_as_tensorflows_eager_tensor_array_infers_them(client):
    """``tf.TensorArray(infer_shape=True)``, the default (TensorFlow 2.21, eager): each
    written shape is merged into the element shape, so unwritten elements stack, read
    and concat as zeros of it (helper-76: they were refused, the element shape not
    fully defined), and a write of another shape is its ValueError, worded as it
    words it. ``unstack`` and ``split`` neither check nor merge, as TensorFlow's."""
    ta = client.tensor_array(F32, size=2, clear_after_read=False).write(0, np.array([1, 2], F32))
    assert ta.element_shape == (2,)
    np.testing.assert_array_equal(ta.stack(), [[1, 2], [0, 0]])
    with pytest.raises(
        ValueError, match=r"^Incompatible shape for value \(\(3,\)\), expected \(\(2,\)\)$"
    ):
        ta.write(1, np.ones(3, F32))
    ta = client.tensor_array(F32, size=2, clear_after_read=False).write(1, np.ones(2, F32))
    np.testing.assert_array_equal(ta.read(0), [0, 0])
    np.testing.assert_array_equal(ta.concat(), [0, 0, 1, 1])
    ta = client.tensor_array(F32, size=2).write(1, np.ones(2, F32))
    np.testing.assert_array_equal(ta.concat(), [0, 0, 1, 1])  # concat first: told there
    ta = client.tensor_array(F32, size=2).scatter([0, 1], np.ones((2, 3), F32))
    with pytest.raises(ValueError, match=r"\(\(2,\)\), expected \(\(3,\)\)"):
        ta.write(0, np.ones(2, F32))
    with pytest.raises(ValueError, match=r"\(\(2,\)\), expected \(\(None, 3\)\)"):
        client.tensor_array(F32, size=2, element_shape=[None, 3]).write(0, np.ones(2, F32))
    ta = client.tensor_array(F32, size=2, infer_shape=False, clear_after_read=False)
    ta.write(0, np.ones(2, F32)).write(1, np.ones(3, F32))  # shapes not inferred: both taken
    np.testing.assert_array_equal(ta.read(1), [1, 1, 1])
    # No shape known: TensorFlow's eager array's ValueError (recorded, TF 2.21).
    with pytest.raises(
        ValueError, match=r"^Cannot convert a partially known TensorShape <unknown> to a Tensor\.$"
    ):
        client.tensor_array(F32, size=1, infer_shape=False).read(0)
    with pytest.raises(ValueError, match=r"TensorShape \(None, 3\) to a Tensor"):
        client.tensor_array(F32, size=1, element_shape=[None, 3]).stack()
    ta = client.tensor_array(F32, size=2).split(np.ones((5, 3), F32), [2, 3])
    assert ta.element_shape is None
    assert ta.concat().shape == (5, 3)
    # Nor does a gather hold what they wrote to the inferred shape (helper-78: it was
    # passed to the server, which refused rows of another shape).
    ta = client.tensor_array(F32, size=4, clear_after_read=False).write(3, np.ones(2, F32))
    ta.unstack(np.ones((3, 5), F32))
    assert ta.gather([0, 1]).shape == (2, 5)
    # The dtype is checked first: a value wrong in both ways is TensorFlow's
    # InvalidArgumentError ([1.5, 2, 3] converts to float32), not the shape's ValueError.
    for wrong in (
        lambda ta: ta.write(0, [1.5, 2, 3]),
        lambda ta: ta.scatter([0], [[1.5, 2, 3]]),
        lambda ta: ta.write(0, np.array([b"ab", b"c", b""], object)),
    ):
        ta = client.tensor_array(np.int32, size=2, element_shape=(2,))
        with pytest.raises(InvalidArgumentError, match="^TensorArray dtype is int32 but Op is"):
            wrong(ta)
        assert ta.element_shape == (2,)
    # A gather of nothing takes the inferred shape too (helper-79: UNIMPLEMENTED).
    assert client.tensor_array(F32, size=2).write(0, np.ones(3, F32)).gather([]).shape == (0, 3)


def test_an_index_out_of_the_array_is_tensorflows_eager_out_of_range_error(client):
    """TensorFlow's eager ``tf.TensorArray`` raises OutOfRangeError, in its words, for an
    index out of the array (recorded, TF 2.21); the op's InvalidArgumentError came
    through (a review helper's differential fuzz)."""
    ta = client.tensor_array(F32, size=1)
    dynamic = client.tensor_array(F32, size=0, dynamic_size=True)
    cases = [
        (
            lambda: ta.write(1, 1.0),
            "Tried to write to index 1 but array is not resizeable and size is: 1 ",
        ),
        (lambda: ta.write(-1, 1.0), "Writing to negative indices (index -1) is not allowed."),
        (
            lambda: ta.scatter([1], [1.0]),
            "Tried to write to index 1 but array is not resizeable and size is: 1 ",
        ),
        (lambda: ta.read(1), "Tried to read from index 1 but array size is: 1 "),
        (lambda: ta.read(-1), "Reading from negative indices (index -1) is not allowed."),
        (lambda: dynamic.read(3), "Tried to read from index 3 but array size is: 0 "),
        (lambda: dynamic.write(-1, 1.0), "Writing to negative indices (index -1) is not allowed."),
    ]
    for call, words in cases:
        with pytest.raises(OutOfRangeError) as raised:
            call()
        assert str(raised.value) == words


def test_indices_are_checked_before_the_value_in_order_as_tensorflows_eager_array(client):
    """TensorFlow's eager array checks each index before the value's dtype and shape,
    element after element (recorded, TF 2.21): the value's error came first here, and a
    scatter named its largest bad index rather than its first (a review helper)."""
    ta = client.tensor_array(F32, size=2, element_shape=[2])
    past = "Tried to write to index {} but array is not resizeable and size is: 2 "
    cases = [
        (lambda: ta.write(5, np.ones(3, F32)), past.format(5)),
        (
            lambda: ta.write(-1, np.ones(3, F32)),
            "Writing to negative indices (index -1) is not allowed.",
        ),
        (lambda: ta.write(5, client.put(np.array([1, 2], np.int32))), past.format(5)),
        (
            lambda: ta.scatter([-1, 5], np.ones((2, 2), F32)),
            "Writing to negative indices (index -1) is not allowed.",
        ),
        (lambda: ta.scatter([3, 7], np.ones((2, 2), F32)), past.format(3)),
        (lambda: ta.scatter([5], np.ones((1, 3), F32)), past.format(5)),
    ]
    for call, words in cases:
        with pytest.raises(OutOfRangeError) as raised:
            call()
        assert str(raised.value) == words
    with pytest.raises(ValueError, match="Incompatible shape"):  # in range: the shape's error
        ta.write(1, np.ones(3, F32))


def test_a_scatter_checks_its_first_element_whole_before_its_later_indices(client):
    """The eager array writes a scatter's elements one after another (index, dtype,
    shape): a bad value fails at the first element, before a later bad index; an
    index the server holds is the op's to check; an array from a handle may be
    dynamic (helper-89: each of these was a false OutOfRangeError or a TypeError)."""
    ta = client.tensor_array(F32, size=2, element_shape=[2])
    with pytest.raises(ValueError, match="Incompatible shape"):
        ta.scatter([0, 5], np.ones((2, 3), F32))
    with pytest.raises(ValueError, match="Incompatible shape"):
        ta.scatter([0, -1], np.ones((2, 3), F32))
    ta = client.tensor_array(F32, size=2, clear_after_read=False)
    ta.write(client.put(np.int32(1)), 1.0)  # (TensorFlow takes a tensor index too)
    assert ta.read(1) == 1.0
    h, flow = client.raw_ops.TensorArrayV3(size=0, dtype=F32, dynamic_size=True, element_shape=[2])
    from_handle = client.tensor_array(F32, handle=h, flow=flow, element_shape=[2])
    from_handle.write(5, np.ones(2, F32))
    with pytest.raises(ValueError, match="Incompatible shape"):
        from_handle.write(6, np.ones(3, F32))  # (dynamic: index 6 is no error)
