"""The gateway <-> engine gRPC contract (engine.proto) and its generated stubs, in the shared core below both.

Import the stubs from here: ``from m3stack.proto import engine_pb2, engine_pb2_grpc``.  The engine's server and the
gateway's engine client import it (the import contract keeps the rest of the gateway off it).  Nothing in this
package imports torch, so the gateway can use it.
"""
