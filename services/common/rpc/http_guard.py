"""What stands in front of every HTTP API of the system (the gateway's OpenAI-compatible routes,
the reward server's OpenRLHF-style API, the learner's status): a pure ASGI middleware, so nothing
of a request is read before it passes, and one error shape for everything the app answers.

    app = FastAPI(docs_url=None, redoc_url=None)
    install_error_handlers(app)                        # 400/404/405/500 ... in the one shape
    guarded = Guard(app, authorized=bearer(token), open_paths={"/health"}, max_body_bytes=8 << 20)

A request, in order:
    headers            over `max_header_bytes` together: 431
    auth               `authorized(method, path, headers)`, unless the path is open: else 401
                       (before one byte of the body is read)
    Content-Length     over `max_body_bytes`: 413 at once; not a number: 400
    body               read here, counting (a chunked body too): over `max_body_bytes`: 413;
                       not all there within `body_timeout_s`: 408 (a body stopped short is not
                       held)
    JSON values        more than `max_json_values` array items, objects and arrays outside its
                       strings: 413 before it is parsed (what parsing costs scales with these,
                       not with bytes: 8 MiB of `{},` would be 2.8 million dicts, 212 MB); a body
                       of one of `binary_types` (protobuf: the Tinker API's) is not JSON and is
                       not counted; then the body is handed to the app as it came
    the app            whatever it raises is answered 500 in the shape (the connection stays
                       usable); after its answer has started, it is logged and swallowed (uvicorn
                       would drop the keep-alive connection otherwise)

The shape (OpenAI's, on every surface): `{"error": {"message", "type", "param", "code"}}` with
`param` the request field at fault (or null) and `code` a string (or null).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)

TYPES = {  # the error "type" of a status (OpenAI's names)
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    499: "invalid_request_error",  # the client closed the connection (nobody reads the answer)
    503: "service_unavailable",
}


def error_body(message: str, kind: str | None = None, param: str | None = None, code: str | None = None) -> dict:
    """The one error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind or "invalid_request_error", "param": param, "code": code}}


def error_bytes(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps(error_body(message, TYPES.get(status, "server_error"), param, code)).encode()


def bearer(token: str | None) -> Callable[[str, str, dict[str, str]], bool]:
    """An `authorized` that asks for `Authorization: Bearer <token>` (everything, with no token)."""
    expected = f"Bearer {token}".encode() if token is not None else None

    def authorized(method: str, path: str, headers: dict[str, str]) -> bool:
        return expected is None or hmac.compare_digest(headers.get("authorization", "").encode(), expected)

    return authorized


Send = Callable[[dict], Awaitable[None]]


async def send_error(
    send: Send,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    body = error_bytes(status, message, param, code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class TooLarge(Exception):
    pass


class TooSlow(Exception):
    pass


BODY_TIMEOUT_S = 30.0  # a request's whole body must arrive within this
MAX_JSON_VALUES = 1 << 18
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_values(body: bytes, bound: int) -> int:
    """An upper estimate of the Python objects parsing `body` as JSON builds beyond its strings'
    characters: its commas, `[` and `{` outside strings. Counted on the bytes (a few ms for 8 MiB);
    only a body with more than `bound` of them anywhere is walked string by string, in place (no
    copy of it), and only until the count outside strings passes `bound`."""
    if _structural(body, 0, len(body)) <= bound:
        return 0
    values, at = 0, 0
    for string in _JSON_STRING.finditer(body):
        values += _structural(body, at, string.start())
        if values > bound:
            return values
        at = string.end()
    return values + _structural(body, at, len(body))


def _structural(body: bytes, start: int, end: int) -> int:
    return body.count(b",", start, end) + body.count(b"[", start, end) + body.count(b"{", start, end)


class Guard:
    """The ASGI middleware the module's docstring describes. `observe(method, path, status,
    seconds)`, when given, is told of every answered request (the 401s and 413s it gives itself
    too): what the HTTP request metrics count."""

    def __init__(
        self,
        app,
        *,
        authorized: Callable[[str, str, dict[str, str]], bool],
        open_paths: frozenset[str] | set[str] = frozenset({"/health"}),
        max_body_bytes: int = 8 << 20,
        max_json_values: int = MAX_JSON_VALUES,
        max_header_bytes: int = 64 << 10,
        observe: Callable[[str, str, int, float], None] | None = None,
        body_timeout_s: float = BODY_TIMEOUT_S,
        auth_hint: str = "missing or wrong bearer token (Authorization: Bearer <token>)",
        binary_types: frozenset[str] = frozenset(),
    ):
        """`auth_hint`: what a 401 says (how this API takes its key); `binary_types`: the
        Content-Types of bodies that are not JSON (their bytes are not counted as JSON values)."""
        self.app, self.authorized, self.open_paths = app, authorized, frozenset(open_paths)
        self.auth_hint, self.binary_types = auth_hint, binary_types
        self.max_body_bytes, self.max_header_bytes, self.observe = max_body_bytes, max_header_bytes, observe
        self.body_timeout_s, self.max_json_values = body_timeout_s, max_json_values

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":  # no API here speaks it
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]
        method, path = scope.get("method", ""), scope.get("path", "")

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._serve(scope, receive, counted, method, path)
        finally:
            if self.observe is not None and status[0]:
                self.observe(method, path, status[0], time.perf_counter() - t0)

    async def _serve(self, scope, receive, send: Send, method: str, path: str) -> None:
        refused = self._refused_on_headers(scope, method, path)
        if refused is not None:
            return await send_error(send, *refused[:2], **refused[2])
        try:
            body = await self._body(receive)
        except TooLarge:
            return await self._too_large(send)
        except TooSlow:  # the rest of the body stays unread: the connection cannot carry another request
            return await send_error(
                send,
                408,
                f"the request body did not arrive within {self.body_timeout_s:g} s",
                code="request_timeout",
                headers=((b"connection", b"close"),),
            )
        if body is None:  # the client went away
            return
        if (
            len(body) > self.max_json_values
            and not self._binary(scope)
            and await self._json_values(body) > self.max_json_values
        ):
            return await send_error(
                send,
                413,
                f"the request body holds more than {self.max_json_values} JSON values (array items, objects, "
                "arrays), this server's limit",
                code="request_too_large",
            )
        await self._app(scope, receive, send, body, method, path)

    def _binary(self, scope) -> bool:
        """Whether the request's body is of one of `binary_types` (not JSON)."""
        kind = next((v for k, v in scope.get("headers") or [] if k.lower() == b"content-type"), b"")
        return kind.decode("latin-1").split(";")[0].strip().lower() in self.binary_types

    async def _json_values(self, body: bytes) -> int:
        """`json_values` of the body: a body with few commas and brackets at once, else on a thread
        (a string-by-string walk takes up to a second of 8 MiB: the loop goes on serving meanwhile)."""
        if _structural(body, 0, len(body)) <= self.max_json_values:
            return 0
        return await asyncio.to_thread(json_values, body, self.max_json_values)

    def _refused_on_headers(self, scope, method: str, path: str) -> tuple[int, str, dict] | None:
        """The answer (status, message, send_error's keywords) to a request refused on its headers
        alone, before one byte of its body is read; None when it passes."""
        raw = scope.get("headers") or []
        if sum(len(k) + len(v) for k, v in raw) > self.max_header_bytes:
            return 431, f"the request's headers are over {self.max_header_bytes} bytes", {}
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
        if path not in self.open_paths and not self.authorized(method, path, headers):
            return 401, self.auth_hint, {"code": "invalid_api_key", "headers": ((b"www-authenticate", b"Bearer"),)}
        length = headers.get("content-length")
        if length is not None:
            if not (length.isascii() and length.isdigit()):
                return 400, "Content-Length: not a number", {"code": "invalid_content_length"}
            if int(length) > self.max_body_bytes:
                return 413, *self._too_large_answer()
        return None

    async def _app(self, scope, receive, send: Send, body: bytes, method: str, path: str) -> None:
        """The app, its body given as it came, then `receive` as it goes on (a disconnect); what it
        raises before answering is a 500 in the shape, after, logged."""
        replayed = [False]

        async def replay() -> dict:
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        started = [False]

        async def tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        try:
            await self.app(scope, replay, tracked)
        except Exception:
            log.exception("%s %s failed", method, path[:200])
            if not started[0]:
                await send_error(send, 500, "internal error (the server logged it)")

    async def _body(self, receive) -> bytes | None:
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise TooSlow from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large_answer(self) -> tuple[str, dict]:
        # the rest of the body stays unread on the connection: it cannot carry another request
        return (
            f"the request body is over {self.max_body_bytes} bytes, this server's limit",
            {"code": "request_too_large", "headers": ((b"connection", b"close"),)},
        )

    async def _too_large(self, send: Send) -> None:
        message, keywords = self._too_large_answer()
        await send_error(send, 413, message, **keywords)


def field_path(loc: tuple | list) -> str | None:
    """A validation error's location as a request field: ("body", "messages", 0, "role") ->
    "messages[0].role"; None for the body itself."""
    parts = [p for p in loc[1:]] if loc and loc[0] in ("body", "query", "path", "header") else list(loc)
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def install_error_handlers(app, validation_status: int = 400) -> None:
    """FastAPI's own errors in the one shape: validation errors as `validation_status` naming the
    field (never echoing the input: NaN cannot be JSON, and a 20 MB body need not come back), a
    body that is not JSON as 400, 404/405 and the other HTTP errors, and any exception as 500."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        errors: list[Any] = list(e.errors())
        first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            reason = (first.get("ctx") or {}).get("error", "")
            return JSONResponse(error_body(f"the body is not valid JSON ({reason})"), status_code=400)
        param = field_path(first.get("loc", ()))
        message = f"{param or 'the body'}: {first.get('msg', 'invalid')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        return JSONResponse(error_body(message, param=param), status_code=validation_status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path[:200]}"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path[:200]}"
        else:
            message = str(e.detail)
        return JSONResponse(
            error_body(message, TYPES.get(e.status_code, "server_error")),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def crashed(request, e: Exception):
        # Starlette sends this, then raises `e` again: `Guard` logs it (with its traceback) and
        # keeps it from reaching uvicorn, which would close the connection
        return JSONResponse(error_body("internal error (the server logged it)", "server_error"), status_code=500)


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}


def document_guard(app, open_paths: frozenset[str] | set[str] = frozenset({"/health"})) -> None:
    """FastAPI's OpenAPI schema as `Guard` and `install_error_handlers` answer: bearer auth on
    every operation but those of `open_paths`, the error shape as every operation's answer other
    than its 2xx (`default`), FastAPI's 422 and its validation-error schemas gone."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {})
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schemas = components.setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            schemas["Error"] = ERROR_SCHEMA
            error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
            for path, operations in schema.get("paths", {}).items():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
                    operation["responses"]["default"] = {"description": "an error, in the one shape", "content": error}
                    operation["security"] = [] if path in open_paths else [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
