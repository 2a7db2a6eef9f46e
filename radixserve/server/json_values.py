"""Values that parse as JSON but that nothing behind the HTTP layer can hold, refused at the edge.

Python's json module accepts strings with lone surrogates ("\\ud800": not Unicode, so no tokenizer
takes them), integers of any size (msgpack, the IPC format, holds 64 bits) and NaN / Infinity (not
JSON at all, but accepted). Each is answered with a 400 that names the field, before any route runs.

The body is parsed once: the edge keeps what it parsed in the request's scope, and the routes
(ParsedJsonRoute) read it from there instead of parsing the bytes again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine, MutableMapping
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from radixserve.server.errors import ApiError

# Integers must fit the 64-bit signed range of the IPC format (token ids are checked further,
# against the vocabulary, by the scheduler).
INT_MIN, INT_MAX = -(2**63), 2**63 - 1


class BadJsonValue(ValueError):
    def __init__(self, path: str, problem: str):
        super().__init__(f"{path or 'the request body'} {problem}")
        self.path = path


# Where the edge leaves the parsed body in the ASGI scope.
PARSED_JSON = "radixserve.parsed_json"


def check_body(body: bytes, scope: MutableMapping[str, Any]) -> None:
    """Raises BadJsonValue for the first value nothing downstream can hold; else keeps the parsed
    value in the scope for the route. A body that is not JSON at all is left to the route, which
    answers it."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise BadJsonValue("", "is nested too deeply") from None
    except ValueError:
        return
    check_value(value)
    scope[PARSED_JSON] = value


class ParsedJsonRequest(Request):
    async def json(self) -> Any:
        if PARSED_JSON in self.scope:
            return self.scope[PARSED_JSON]
        return await super().json()


class ParsedJsonRoute(APIRoute):
    """A route whose request body, as JSON, is the one the edge already parsed."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(ParsedJsonRequest(request.scope, request.receive))

        return route


def check_value(value: Any) -> None:
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            _check_text(path, item)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                raise BadJsonValue(path, "is an integer beyond the 64-bit range")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise BadJsonValue(path, "must be a finite number (NaN and Infinity are not JSON)")
        elif isinstance(item, dict):
            for key, child in item.items():
                # The name as the client sent it, but with an invalid one escaped: it is echoed back.
                named = f"{path}.{_printable(key)}" if path else _printable(key)
                _check_text(named, key)
                stack.append((named, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{index}]", child) for index, child in enumerate(item))


def _printable(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_text(path: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadJsonValue(path, "is not valid Unicode (it holds a lone surrogate)") from None


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object (a 400 for anything else)."""
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body
