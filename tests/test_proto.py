"""engine.proto: the committed stubs are current and every message survives a round trip."""

import filecmp

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.message import Message

from m3stack.proto import engine_pb2, engine_pb2_grpc, generate


def test_committed_stubs_match_the_proto(tmp_path):
    for fresh in generate.generate(tmp_path):
        committed = generate.PROTO_DIR / fresh.name
        assert filecmp.cmp(fresh, committed, shallow=False), (
            f"{committed.name} is stale: run `python -m m3stack.proto.generate`"
        )


def _all_message_classes() -> list[type[Message]]:
    return [getattr(engine_pb2, name) for name in engine_pb2.DESCRIPTOR.message_types_by_name]


def _fill(message: Message, depth: int = 0) -> None:
    """Set every field (one branch of each oneof) to a non-default value."""
    filled_oneofs: set[str] = set()
    for field in message.DESCRIPTOR.fields:
        oneof = field.containing_oneof
        if oneof is not None and not oneof.name.startswith("_"):
            if oneof.name in filled_oneofs:
                continue
            filled_oneofs.add(oneof.name)
        value = _sample_value(field, depth)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = (
                field.message_type.fields_by_name["key"],
                field.message_type.fields_by_name["value"],
            )
            container = getattr(message, field.name)
            for offset in (0, 1):
                container[_sample_value(key_field, depth + offset)] = _sample_value(value_field, depth)
        elif field.is_repeated:
            container = getattr(message, field.name)
            if field.message_type is not None:
                _fill(container.add(), depth + 1)
                _fill(container.add(), depth + 1)
            else:
                container.extend([value, value])
        elif field.message_type is not None:
            _fill(getattr(message, field.name), depth + 1)
        else:
            setattr(message, field.name, value)


def _sample_value(field, depth: int):
    t = descriptor_pb2.FieldDescriptorProto
    if field.type == t.TYPE_STRING:
        return f"{field.name}-{depth}-\u00e9"
    if field.type == t.TYPE_BYTES:
        return bytes(range(7))
    if field.type == t.TYPE_BOOL:
        return True
    if field.type in (t.TYPE_FLOAT, t.TYPE_DOUBLE):
        return 0.25
    if field.type == t.TYPE_ENUM:
        return field.enum_type.values[-1].number
    if field.type == t.TYPE_MESSAGE:
        return None
    return 7 + depth


@pytest.mark.parametrize("cls", _all_message_classes(), ids=lambda c: c.__name__)
def test_every_message_round_trips(cls):
    original = cls()
    _fill(original)
    decoded = cls.FromString(original.SerializeToString())
    assert decoded == original
    # Non-empty messages really carry data, so the equality above is not vacuous.
    if original.DESCRIPTOR.fields:
        assert original.ByteSize() > 0


def test_sampling_fields_distinguish_unset_from_zero():
    params = engine_pb2.SamplingParams()
    assert not params.HasField("temperature")
    params.temperature = 0.0
    decoded = engine_pb2.SamplingParams.FromString(params.SerializeToString())
    assert decoded.HasField("temperature") and decoded.temperature == 0.0


def test_generate_response_oneof_holds_one_branch():
    response = engine_pb2.GenerateResponse(request_id="r", chunk=engine_pb2.GenerateChunk(token_ids=[1]))
    response.complete.finish_reason = engine_pb2.FINISH_REASON_STOP
    assert response.WhichOneof("response") == "complete"


def test_service_has_the_contract_methods():
    service = engine_pb2.DESCRIPTOR.services_by_name["Engine"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "GenerateStream", "Abort", "HealthCheck", "GetModelInfo", "GetLoads"}
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert methods["GenerateStream"].server_streaming and methods["GenerateStream"].client_streaming
    assert hasattr(engine_pb2_grpc, "EngineStub") and hasattr(engine_pb2_grpc, "EngineServicer")
