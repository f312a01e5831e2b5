"""Typed ipc errors. Every message says what was wrong and what to do about it."""


class IpcError(Exception):
    """Base class of every error the ipc layer raises on purpose."""


class AllocatorUnavailableError(IpcError):
    """The requested buffer allocator cannot work on this machine (device absent, no access)."""


class AllocationError(IpcError):
    """The kernel refused to allocate or export a buffer."""


class InvalidHandleError(IpcError, ValueError):
    """A tensor handle is malformed or does not match the producer's pool."""


class DescriptorError(InvalidHandleError):
    """Shape, dtype, strides, offset and nbytes of a descriptor are inconsistent."""


class SlotOutOfRangeError(InvalidHandleError):
    """A handle names a slot the producer's ring does not have."""


class StaleHandleError(InvalidHandleError):
    """The slot was rewritten (newer sequence) or replaced (newer generation) since publish."""


class UnknownPoolError(InvalidHandleError):
    """No producer with this pool_id is listening in the socket directory."""


class PoolUnreachableError(UnknownPoolError):
    """The producer's socket exists but refuses connections (producer dead or on another host).

    The node layer catches this to switch a consumer to the copying fallback topic.
    """


class InflightLimitError(IpcError):
    """The consumer already holds max_inflight frames of this pool: release one first."""


class PoolExhaustedError(IpcError):
    """The producer has no free slot to loan (all held or loaned): publish or raise slots."""


class AdmissionError(IpcError):
    """The producer refused a consumer: its max_inflight does not fit the free ring capacity."""


class PeerCredentialsError(IpcError):
    """The process at the other end of the socket runs as another user."""


class InsecureDirectoryError(IpcError):
    """The socket directory is not a private (0700, own uid, not a symlink) directory."""


class BufferValidationError(IpcError):
    """A received buffer fd is not what the producer claims (unsealed, truncated, wrong kind)."""


class ProtocolError(IpcError):
    """A peer sent a malformed or unexpected message (or truncated control data)."""


class PoolClosedError(IpcError):
    """The pool (or the connection to it) was closed; its producer stopped or died."""
