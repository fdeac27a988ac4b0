"""The gateway's view of its engines: gRPC clients, discovery, health and circuit breakers."""
