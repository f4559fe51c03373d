"""gRPC channel and server options, set explicitly in one place."""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_MESSAGE_LIMITS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

SERVER_OPTIONS = _MESSAGE_LIMITS + [
    # gRPC sets SO_REUSEPORT by default: a second server on a port in use (a
    # second `llmserve serve`, or a port picked free and taken before its
    # service bound it) then shared it silently, each getting some of the
    # connections. Off, the second fails to bind and says so.
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

CHANNEL_OPTIONS = _MESSAGE_LIMITS + [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A restarted worker or engine core is back within seconds, and a stack's
    # services start together, each waiting for the next: retry the connection
    # every 0.5 s at most (gRPC's default backoff grows to 120 s; with 2 s, each
    # hop of a stack's start could wait that long after the next service was up).
    # A refused connect on loopback is cheap.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
