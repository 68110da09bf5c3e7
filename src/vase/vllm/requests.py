"""Per-request vase fields (``SamplingParams.extra_args``, the OpenAI server's ``vllm_xargs``), checked where vLLM
checks a request: in the front end, before the engine sees it.

The check rides on vLLM's public hook for request validation, a logits processor's ``validate_params`` (vLLM calls it
for every request at admission and answers a ``ValueError`` with HTTP 400 naming it); :class:`VaseRequestFields`
changes no logits. :func:`vase.vllm.engine_args` and ``python -m vase.vllm.serve`` register it. A request with a
bad value then fails alone with an error naming the field; the engine and the other requests go on.

vLLM's OpenAI request model coerces a JSON ``true`` in ``vllm_xargs`` to the integer 1 before any processor sees it,
so the server also checks the fields as sent, in an ASGI middleware
(:class:`vase.vllm.middleware.VaseFieldsMiddleware`, added by
``python -m vase.vllm.serve`` with vLLM's ``--middleware``): a boolean is refused there with the same 400.

Fields: ``vase_seed`` (an integer in ``[0, 2**63)``: the seed of the request's sampled eviction) and
``vase_budget`` (the request's own budget, at most the engine's ``max_budget``, or ``"full"`` where the engine
allows it), checked against the engine's configuration (:func:`vase.vllm.settings.front_end_settings`). Any other key
starting with ``vase_`` is refused (a misspelt field would otherwise be ignored silently).
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from .settings import check_fields, front_end_settings


class VaseRequestFields(LogitsProcessor):
    """Checks each request's vase fields at admission (:func:`vase.vllm.settings.check_fields`); leaves the logits
    unchanged."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        check_fields(getattr(sampling_params, "extra_args", None), front_end_settings())

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True  # never changes the logits: vLLM may skip it for greedy requests

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
