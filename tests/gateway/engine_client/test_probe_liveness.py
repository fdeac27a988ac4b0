"""A probe that times out takes an engine down only when nothing else says it is alive: the engine's streams
delivering responses during the probe keep it up (busy, not gone), so its requests are not cancelled."""

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from m3stack.gateway.engine_client.breaker import BreakerSettings
from m3stack.gateway.engine_client.client import EngineClient, EngineStatus, ProbeSettings
from m3stack.gateway.metrics import GatewayMetrics
from m3stack.local.processes import free_port

PROBE = ProbeSettings(interval_s=0.1, timeout_s=0.2, failures_to_down=2)
PROBES = 4  # twice what takes a silent engine down


class SlowHealth(HealthServicer):
    """Answers every check after the probe's deadline, as a starved engine process would."""

    async def Check(self, request, context):  # noqa: N802 (the gRPC method's name)
        await asyncio.sleep(PROBE.timeout_s * 3)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def probe_a_slow_engine(streams_deliver: bool) -> EngineStatus:
    async def scenario() -> EngineStatus:
        address = f"127.0.0.1:{free_port()}"
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(SlowHealth(), server)
        server.add_insecure_port(address)
        await server.start()
        engine = EngineClient(address, BreakerSettings(), PROBE, GatewayMetrics("m3"))
        engine.status = EngineStatus.READY  # as after earlier probes answered in time
        try:
            for _ in range(PROBES):
                probe = asyncio.create_task(engine.probe())
                if streams_deliver:
                    await asyncio.sleep(PROBE.timeout_s / 2)
                    engine.note_response()  # what EngineStream.read does with each response
                await probe
            return engine.status
        finally:
            await engine.close()
            await server.stop(None)

    return asyncio.run(scenario())


def test_a_silent_engine_whose_probes_time_out_goes_down():
    assert probe_a_slow_engine(streams_deliver=False) is EngineStatus.DOWN


def test_an_engine_whose_streams_deliver_stays_up_while_its_probes_time_out():
    assert probe_a_slow_engine(streams_deliver=True) is EngineStatus.READY
