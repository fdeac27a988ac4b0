"""The gateway <-> engine gRPC contract (engine.proto) and its generated stubs.

Import the stubs from here: ``from m3stack.engine.proto import engine_pb2, engine_pb2_grpc``.
Nothing in this package imports torch, so the gateway can use it.
"""
