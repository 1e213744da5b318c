"""ASGI middleware in front of every route: API-key check and request-body size limit."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.runtime.entrypoints.protocol import BodyTooLarge, error_body

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no credentials


class RequestGuard:
    """401 without `Authorization: Bearer <api_key>` (when one is set); 413 for bodies over
    `max_body_bytes`, by Content-Length up front and by counting what arrives (chunked uploads
    have no Content-Length; a client may also lie in it)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 open_paths: frozenset[str] = frozenset()) -> None:
        """`open_paths`: served without the key besides /health (the playground's static
        files, which hold no data; every API call the page makes carries the key)."""
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = OPEN_PATHS | open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # raw lower-case byte names; a repeated header: last
        if self.key is not None and scope["path"] not in self.open_paths:
            if not self._authorized(headers.get(b"authorization", b"")):
                body = error_body("invalid or missing API key (Authorization: Bearer <key>)",
                                  None, 401, "authentication_error")
                await _send_json(send, 401, body, {b"www-authenticate": b"Bearer"})
                return
        declared = headers.get(b"content-length")
        if declared is not None and not declared.isdigit():
            await _send_json(send, 400, error_body("invalid Content-Length", None, 400))
            return
        if declared is not None and int(declared) > self.max_body_bytes:
            await _send_json(send, 413, error_body(self._too_large(), None, 413))
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self._too_large())
            return message

        await self.app(scope, limited_receive, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        # compare_digest takes time independent of where the bytes differ
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def _too_large(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_body_bytes} " \
               "bytes"


async def _send_json(send: Send, status: int, body: dict,
                     extra: dict[bytes, bytes] | None = None) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode()), *(extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
