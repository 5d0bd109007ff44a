"""Constants both ends of the wire agree on."""

#: Request metadata naming the session; a routing proxy keys on it.
SESSION_METADATA_KEY = "x-gradserve-session"

#: Request metadata: outputs larger than this many bytes are kept in the session
#: (transient) and streamed back with GetTensor instead of sent inline.
INLINE_LIMIT_METADATA_KEY = "x-gradserve-inline-limit"

#: Default ceiling of one unary message, each direction.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

#: Size of one PutTensor/GetTensor chunk.
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024

#: Tensors at least this large travel by stream rather than inline.
DEFAULT_STREAM_THRESHOLD_BYTES = 32 * 1024 * 1024


#: Channel options for unary messages up to ``limit`` bytes.
def channel_options(limit: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]
