"""The vase fields of a request as the client sent them, checked in vLLM's OpenAI server before its request model
reads them (an ASGI middleware, vLLM's ``--middleware`` extension point; ``python -m vase.vllm.serve`` adds it).

vLLM's request model coerces a JSON ``true`` in ``vllm_xargs`` to the integer 1 (its values are ``str | int |
float``), so the logits processor that checks each request (:mod:`vase.vllm.requests`) would see
``"vase_budget": true`` as a budget of 1 and ``"vase_seed": true`` as seed 1. No vLLM import: tested on its own.
"""

from __future__ import annotations

import json

from .settings import check_fields, front_end_settings


class VaseFieldsMiddleware:
    """ASGI middleware for vLLM's OpenAI server (its ``--middleware`` flag; ``python -m vase.vllm.serve`` adds it):
    checks the vase fields of a request's ``vllm_xargs`` as the client sent them, before vLLM's request model reads
    them. That model coerces JSON ``true`` to the integer 1 (``vllm_xargs`` values are ``str | int | float``), so
    ``"vase_budget": true`` would reach :class:`vase.vllm.requests.VaseRequestFields` as a budget of 1 and
    ``"vase_seed": true`` as seed 1; here a boolean, or any value :func:`vase.vllm.settings.check_fields` refuses, is
    answered with HTTP 400 naming the field, in the OpenAI error format. Requests without vase fields pass untouched
    (their body replayed).

    Args:
        app: the ASGI application it wraps.
    """

    PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in self.PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        error = _field_error(body)
        if error is not None:
            return await _bad_request(send, error)
        replay = _replay([{"type": "http.request", "body": body, "more_body": False}], receive)
        return await self.app(scope, replay, send)


def _field_error(body: bytes) -> str | None:
    """The error of a request body's vase fields (None: no vase field, fine, or not JSON: vLLM answers that)."""
    try:
        xargs = json.loads(body).get("vllm_xargs")
    except (ValueError, AttributeError):
        return None
    if not isinstance(xargs, dict) or not any(isinstance(k, str) and k.startswith("vase_") for k in xargs):
        return None
    try:
        check_fields(xargs, front_end_settings())
    except ValueError as exc:
        return str(exc)
    return None


def _replay(messages: list[dict], original):
    """A ``receive`` that gives ``messages``, then what the ``original`` receive gives (the client's disconnect)."""
    queue = list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        return await original()

    return receive


async def _bad_request(send, message: str) -> None:
    payload = json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
