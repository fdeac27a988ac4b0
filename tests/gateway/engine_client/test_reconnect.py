"""An engine's channel finds an engine that comes up after a long absence (a model loading for minutes) within
about a second, not after gRPC's default reconnect backoff (growing to 120 s)."""

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from m3stack.gateway.engine_client.breaker import BreakerSettings
from m3stack.gateway.engine_client.client import EngineClient, ProbeSettings
from m3stack.gateway.metrics import GatewayMetrics
from m3stack.local.processes import free_port

# Long enough for the default backoff to leave 10-20 s between attempts (1, 1.6, 2.6, 4.1, 6.6, 10.5, 16.8 s...).
ABSENCE_S = 30.0
# The capped backoff (1 s, with gRPC's 20 % jitter) plus a handshake on a busy machine.
FOUND_WITHIN_S = 3.0
GIVE_UP_S = 60.0


@pytest.mark.slow
def test_a_channel_finds_an_engine_that_comes_up_late_within_seconds():
    async def scenario() -> float:
        """Seconds from the server's start to the first health check it answers."""
        address = f"127.0.0.1:{free_port()}"
        engine = EngineClient(address, BreakerSettings(), ProbeSettings(), GatewayMetrics("m3"))
        checks = health_pb2_grpc.HealthStub(engine.channel)
        request = health_pb2.HealthCheckRequest(service="")
        with pytest.raises(grpc.aio.AioRpcError):  # nothing listens: the channel starts backing off
            await checks.Check(request, timeout=1.0)
        await asyncio.sleep(ABSENCE_S)

        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
        server.add_insecure_port(address)
        await server.start()
        started = time.monotonic()
        try:
            while time.monotonic() - started < GIVE_UP_S:  # as the pool probes: not waiting for the channel
                try:
                    await checks.Check(request, timeout=1.0)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
            return time.monotonic() - started
        finally:
            await engine.close()
            await server.stop(None)

    assert asyncio.run(scenario()) < FOUND_WITHIN_S
