"""The hint plane's server side: gRPC ``kvtier.v1.HintService``.

Modules: :mod:`~kvtier.hints.server` (grpc.aio server, auth, TLS, health,
metrics endpoint), :mod:`~kvtier.hints.apply` (validation and application of
hint batches to an :class:`~kvtier.agents.AgentGraph`; no grpc),
:mod:`~kvtier.hints.metrics` (Prometheus collector),
:mod:`~kvtier.hints.codegen` (regenerates ``_gen``; needs grpcio-tools).

This package may import grpc and protobuf; ``import kvtier`` never imports
it. It imports nothing eagerly. Recording what the server applied is
:class:`kvtier.recording.hints.HintRecorder`.
"""

DEFAULT_ADDRESS = "127.0.0.1:50051"
"""Where ``kvtier serve`` listens and the SDK connects unless told otherwise."""
