"""Generated protobuf / gRPC stubs of ``proto/kvtier/v1/hints.proto``.

Do not edit the ``hints_pb2*`` files: regenerate them with
``python -m kvtier.hints.codegen``.
"""
