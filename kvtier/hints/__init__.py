"""The hint plane's server side: gRPC ``kvtier.v1.HintService`` and recording.

Modules: :mod:`~kvtier.hints.server` (grpc.aio server, auth, TLS, health,
metrics endpoint), :mod:`~kvtier.hints.apply` (validation and application of
hint batches to an :class:`~kvtier.agents.AgentGraph`; no grpc),
:mod:`~kvtier.hints.recorder` (AgentX / Weka traces + hints side file),
:mod:`~kvtier.hints.metrics` (Prometheus collector),
:mod:`~kvtier.hints.codegen` (regenerates ``_gen``; needs grpcio-tools).

This package may import grpc and protobuf; ``import kvtier`` never imports
it. It imports nothing eagerly, so ``import kvtier.hints.recorder`` stays
cheap.
"""

DEFAULT_ADDRESS = "127.0.0.1:50051"
"""Where ``kvtier serve`` listens and the SDK connects unless told otherwise."""
