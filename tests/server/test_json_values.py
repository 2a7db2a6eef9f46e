"""The edge parses each JSON body once: routes read what the guard middleware parsed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel

from radixserve.server.http import GuardMiddleware
from radixserve.server.json_values import ParsedJsonRoute


class Body(BaseModel):
    prompt: list[int]


def make_app() -> FastAPI:
    app = FastAPI()
    app.router.route_class = ParsedJsonRoute
    app.add_middleware(GuardMiddleware, api_key=None, max_body_bytes=2**20)

    @app.post("/model")
    async def model(body: Body) -> dict[str, Any]:
        return {"sum": sum(body.prompt)}

    @app.post("/raw")
    async def raw(request: Request) -> dict[str, Any]:
        value = await request.json()
        return {"keys": sorted(value)}

    return app


@pytest.mark.parametrize(("path", "answer"), [("/model", {"sum": 6}), ("/raw", {"keys": ["prompt"]})])
def test_each_body_is_parsed_once(monkeypatch: pytest.MonkeyPatch, path: str, answer: dict[str, Any]) -> None:
    calls = []
    loads = json.loads

    def counting_loads(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return loads(*args, **kwargs)

    client = TestClient(make_app())
    monkeypatch.setattr(json, "loads", counting_loads)
    response = client.post(
        path, content=b'{"prompt": [1, 2, 3]}', headers={"content-type": "application/json"}
    )
    monkeypatch.undo()
    assert response.status_code == 200 and response.json() == answer
    assert calls == [b'{"prompt": [1, 2, 3]}']


def test_a_body_that_is_not_json_is_left_to_the_route() -> None:
    client = TestClient(make_app())
    response = client.post("/model", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 422
