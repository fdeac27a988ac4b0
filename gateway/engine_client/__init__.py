"""The gateway's client of the engines' RPC service: a gRPC channel per engine (``client``), discovery, health
probes, circuit breakers, the shared stream, and the one translation between the gateway's types and engine.proto:
``requests`` (what the gateway asks for), ``events`` (what a stream says) and ``wire`` (the messages)."""
