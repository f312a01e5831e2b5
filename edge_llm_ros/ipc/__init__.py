"""Zero-copy tensors between processes: fd-backed buffer pools (no rclpy in here).

- allocators: DMA heap / udmabuf / sealed memfd behind one interface (+ extension point).
- mapping: read-only mappings of received fds, after checking seals, size and kind.
- descriptor: TensorDescriptor (what travels on topics), its validation and msg conversion.
- protocol, channel: the pool socket (SOCK_SEQPACKET, SCM_RIGHTS, SO_PEERCRED).
- pool: the producer's ring (loan -> write -> publish, holds, leases, copy fallback).
- resolver: the consumer side (TensorResolver.resolve/release, push subscriptions).
"""
