"""The completion fast path serves only what FastAPI would read as JSON; the rest goes to FastAPI."""

import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.testclient import TestClient

from m3stack.gateway.api.fast_path import read_as_json

CONTENT_TYPES = [
    None,
    "",
    "application/json",
    "application/json; charset=utf-8",
    "APPLICATION/JSON",
    " application/json ;charset=latin-1",
    "application/vnd.api+json",
    "application/ld+json; profile=x",
    "application/jsonx",
    "application/json-seq",
    "application/x-www-form-urlencoded",
    "application/",
    "application",
    "text/json",
    "text/plain",
    "json",
    "multipart/form-data; boundary=x",
    "application/json, text/plain",
    "application/json garbage",
]


class Body(BaseModel):
    x: int


@pytest.fixture(scope="module")
def fastapi_client():
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: Body) -> dict:
        return {"x": body.x}

    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_json_is_read_exactly_when_fastapi_reads_it(fastapi_client, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    response = fastapi_client.post("/echo", content=b'{"x": 1}', headers=headers)
    assert response.status_code in (200, 422), response.text
    asgi_headers = [(name.encode(), value.encode()) for name, value in headers.items()]
    assert read_as_json(asgi_headers) == (response.status_code == 200)
