"""ASGI middleware guarding the app: the request body's size and the API key."""

from __future__ import annotations

import hmac

from mlx_spec.serving.errors import APIError

from starlette.exceptions import HTTPException


class BodyLimit:
    """Refuse request bodies over `limit` bytes (413), declared or streamed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large().response(scope["path"])(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body exceeds {self.limit} bytes", code="request_too_large"
        )


class APIKey:
    """Refuse `/v1/*` requests without the API key (401)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            given = given or headers.get(b"x-api-key", b"").strip()  # Anthropic's header
            if not hmac.compare_digest(given, self.key):
                error = APIError(
                    401, "missing or invalid API key (Authorization: Bearer ... or x-api-key)",
                    code="invalid_api_key",
                )  # fmt: skip
                return await error.response(scope["path"])(scope, receive, send)
        await self.app(scope, receive, send)
