"""The server's check of the vase fields as the client sent them (:class:`vase.vllm.middleware.VaseFieldsMiddleware`),
on its own: a stand-in ASGI app behind it, no vLLM. vLLM's request model turns a JSON ``true`` into 1 before its
logits processors see it, so a boolean must be refused here."""

from __future__ import annotations

import asyncio
import json

import pytest

from vase.vllm.middleware import VaseFieldsMiddleware


def _call(body: dict, path: str = "/v1/completions") -> tuple[int, dict | None, bytes | None]:
    """``(status, error JSON or None, the body the app read or None)`` of one POST through the middleware; the app
    answers 200 with what it read."""
    seen = {}

    async def app(scope, receive, send):
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        seen["body"] = b"".join(chunks)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    raw = json.dumps(body).encode()
    parts = [raw[: len(raw) // 2], raw[len(raw) // 2 :]]  # two chunks, as a client may send them
    incoming = [{"type": "http.request", "body": p, "more_body": i == 0} for i, p in enumerate(parts)]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path}
    asyncio.run(VaseFieldsMiddleware(app)(scope, receive, send))
    status = sent[0]["status"]
    error = json.loads(sent[1]["body"])["error"] if status != 200 else None
    return status, error, seen.get("body")


@pytest.mark.parametrize(
    "xargs, words",
    [
        ({"vase_budget": True}, "vase_budget must be an integer number of tokens or 'full', got True"),
        ({"vase_seed": True}, "vase_seed must be an integer in [0, 2**63), got True"),
        ({"vase_seed": 1.5}, "vase_seed must be an integer"),
        ({"vase_sed": 3}, "unknown vase field(s) vase_sed"),
    ],
)
def test_booleans_and_bad_vase_fields_are_refused_as_sent(xargs, words):
    status, error, read = _call({"model": "m", "prompt": "hi", "vllm_xargs": xargs})
    assert status == 400 and words in error["message"] and error["code"] == 400 and read is None


def test_other_requests_reach_the_app_with_their_body_whole():
    for body in (
        {"model": "m", "prompt": "hi", "vllm_xargs": {"vase_budget": 96, "vase_seed": 7, "other": True}},
        {"model": "m", "prompt": "hi", "vllm_xargs": {"other_plugin": True}},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    ):
        status, error, read = _call(body, "/v1/chat/completions" if "messages" in body else "/v1/completions")
        assert status == 200 and error is None and json.loads(read) == body
