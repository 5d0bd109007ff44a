"""Constants both ends of the wire agree on."""

#: Request metadata naming the session; a routing proxy keys on it.
SESSION_METADATA_KEY = "x-gradserve-session"

#: Request metadata: the id of one call, logged by the server and returned in its
#: trailing metadata (and on SDK errors as ``.request_id``).
REQUEST_ID_KEY = "x-request-id"

#: Request metadata: ids of transient tensors the client has read in full,
#: comma-separated, at most ``MAX_FETCHED_IDS``; the server deletes them when the call
#: arrives, before it runs (``client/_fetched.py``).
FETCHED_METADATA_KEY = "x-gradserve-fetched"
#: Ids one call may name there (gRPC's metadata limit is 8 KiB; an id is ~22 bytes).
MAX_FETCHED_IDS = 64

#: The ``google.rpc.ErrorInfo.domain`` of the error details gradserve sends (the
#: server, and deploy/nginx's answer to a call it could not pass on): the SDK reads
#: a reason only from this domain.
ERROR_DOMAIN = "gradserve"

#: Request metadata: outputs larger than this many bytes are kept in the session
#: (transient) and streamed back with GetTensor instead of sent inline.
INLINE_LIMIT_METADATA_KEY = "x-gradserve-inline-limit"
#: The gradient tapes an op call records on: comma-separated tape ids (StartTape).
#: Without it nothing is recorded.
TAPE_METADATA_KEY = "x-gradserve-tape"

#: Request metadata: the most tensor bytes the client takes inline in one response
#: (its channel's receive limit, less room for the rest of the message); the server
#: sends what does not fit as transient tensors.
RESPONSE_BUDGET_METADATA_KEY = "x-gradserve-response-budget"

#: Request metadata: the name of a shared-memory region of the session (same-host
#: workers, ``RegisterSharedMemory``) into which the call writes the outputs it
#: returns, one after another from its start; what does not fit comes as usual.
OUTPUT_REGION_METADATA_KEY = "x-gradserve-output-region"

#: Room in a message for everything but its tensors' bytes (field tags, lengths,
#: refs, handles, an error message), when budgeting inline bytes.
MESSAGE_OVERHEAD_BYTES = 64 * 1024

#: Room in a streamed chunk's message for everything but its data (dtype, shape,
#: tags): chunks carry at most the message limit less this.
CHUNK_HEADER_BYTES = 1024


def encoded_size(nbytes: int, ndim: int) -> int:
    """At most what a tensor of ``nbytes`` content and ``ndim`` dims adds to a message
    (its content, dtype, tags and lengths, up to 11 bytes per dim, and ``Tensor.padding``:
    17 bytes, or up to 33 where the padding pushes a length past a varint boundary,
    which only a content of 2 MiB or more has, whose dims then use at most 5 of their
    11 bytes): both ends budget inline tensors with it."""
    return nbytes + 48 + 11 * ndim


#: Fields, at every depth (each element of a repeated or packed field one), that one
#: request may hold; the server refuses one with more (RESOURCE_EXHAUSTED) before
#: parsing it, and the SDK splits deletes, watches and batches to stay under it: see
#: ``gradserve/wire_fields.py``.
MAX_REQUEST_FIELDS = 1 << 16

#: Default ceiling of one unary message, each direction.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

#: Size of one PutTensor/GetTensor chunk. Measured on loopback (2-core machine):
#: 1 MiB chunks moved 256 MiB there and back in ~360 ms, 4-8 MiB chunks in ~650 ms
#: (each copy of a chunk stays in cache). Both ends can set another size.
DEFAULT_CHUNK_BYTES = 1024 * 1024

#: Tensors at least this large travel by stream rather than inline (the SDK puts
#: such inputs first and asks for such outputs by id). One large unary message is
#: slow in gRPC Python: on loopback (2-core machine, `make bench` section (d)) a
#: 16 MiB result came back in 80-100 ms inline and ~18 ms streamed. Below that the
#: answer depends on how warm the allocator is: at 4 MiB the stream was 3.2x faster
#: in a fresh server process and even (1.06x) once warm; at 1-2 MiB it won fresh (1.4-1.8x)
#: and lost warm (0.6-0.8x), as its extra RPCs cost more than the message saves.
DEFAULT_STREAM_THRESHOLD_BYTES = 4 * 1024 * 1024


#: Channel options for unary messages up to ``limit`` bytes.
def channel_options(limit: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]


#: Every op RPC and its field in ``BatchStep``/``BatchResult`` (the RPC name in
#: snake case). Server and SDK both use this table; a test checks it against
#: the proto.
BATCH_FIELDS: dict[str, str] = {
    "TensorArrayV3": "tensor_array_v3",
    "TensorArrayWriteV3": "tensor_array_write_v3",
    "TensorArrayReadV3": "tensor_array_read_v3",
    "TensorArrayGatherV3": "tensor_array_gather_v3",
    "TensorArrayScatterV3": "tensor_array_scatter_v3",
    "TensorArrayConcatV3": "tensor_array_concat_v3",
    "TensorArraySplitV3": "tensor_array_split_v3",
    "TensorArraySizeV3": "tensor_array_size_v3",
    "TensorArrayCloseV3": "tensor_array_close_v3",
    "TensorArrayGradV3": "tensor_array_grad_v3",
    "TensorArrayGradWithShape": "tensor_array_grad_with_shape",
    "StopGradient": "stop_gradient",
    "BlockLSTMV2": "block_lstm_v2",
    "BlockLSTMGradV2": "block_lstm_grad_v2",
    "BlockLSTM": "block_lstm",
    "BlockLSTMGrad": "block_lstm_grad",
    "Gradients": "gradients",
    "WatchTensors": "watch_tensors",
}

#: The first bytes of a shared-memory region hold the nonce that registered it: no
#: tensor is ever placed there (by the SDK or the server), so the nonce stays
#: unguessable and only its owner can register the region again (after a restart).
SHM_RESERVED_BYTES = 64
