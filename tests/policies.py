"""The policy matrix: every policy, plain and with a demanding option set, for every integration's equivalence tests.

Each evicting policy of :data:`vase.POLICY_NAMES` appears twice: as named (its defaults), and with options that
exercise more of the machinery (sampled selection, a value guard, value weights, an outlier rule, a dense prompt),
in the spirit of kvpress's test presets. A policy file added to ``vase.core.policies`` is in the matrix without
editing any test: its demanding set defaults to :data:`DEFAULT_DEMANDING`.
"""

from __future__ import annotations

import vase

DEFAULT_DEMANDING = "selector=sample:guard=range"
DEMANDING = {
    "streaming_llm": "guard=range:selector=sample",
    "h2o": "value_weight=l1:guard=range",
    "tova": "value_weight=output_error:selector=sample",
    "snapkv": "selector=sample:guard=range:value_weight=output_error",
    "rkv": "value_weight=l1:guard=l2:guard_rule=outlier:outlier_factor=3",
    "random": "guard=range",
    "keydiff": "selector=sample:guard=var",
    "knorm": "guard=range:selector=sample",
    "curdkv": "guard=range:selector=sample",
    "vase": "preset=paper",  # the published method: a dense prompt, the reference's slot order
    "vase_dkv": "selector=topk:guard=l2",
}


def evicting_names() -> list[str]:
    """The policies that evict (not ``full``, not the selection policy ``quest``)."""
    return [p for p in vase.POLICY_NAMES if vase.make_policy(p).evicts]


def variants() -> list[str]:
    """Every evicting policy, plain then demanding: ``['streaming_llm', 'streaming_llm:guard=range:...', ...]``."""
    out = []
    for name in evicting_names():
        out += [name, f"{name}:{DEMANDING.get(name, DEFAULT_DEMANDING)}"]
    return out


def compresses_prompt(spec: str) -> bool:
    """Whether the policy compresses a prompt longer than the budget at prefill (False: dense until its first
    eviction)."""
    from vase.core.policies import parse_policy_spec

    name, options = parse_policy_spec(spec)
    return vase.make_policy(name, **options).compress_prompt
