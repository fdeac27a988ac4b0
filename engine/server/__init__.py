"""The engine's edges: the gRPC service (engine.proto + grpc.health.v1), metrics and probes over HTTP, drain.

``async_engine`` runs the ``EngineCore`` step loop on its own thread and bridges it to asyncio;
``grpc_server`` maps engine.proto onto it; ``serve`` is one engine process from start to exit.
"""
