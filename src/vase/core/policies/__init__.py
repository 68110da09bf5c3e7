"""The policies (eviction, and one selection policy: ``quest``), one module each, by standard name.

``make_policy(name, **options)`` builds one; ``POLICY_NAMES`` lists them; ``policy_table()`` gives (name, what it
keeps, source) rows for documentation.
"""

from __future__ import annotations

from types import ModuleType

from ..policy import Policy, did_you_mean
from . import (
    curdkv,
    full,
    h2o,
    keydiff,
    knorm,
    learned,
    quest,
    random,
    rkv,
    snapkv,
    streaming_llm,
    tova,
    vase,
    vase_dkv,
)

_MODULES: dict[str, ModuleType] = {
    m.NAME: m
    for m in (
        full,
        streaming_llm,
        h2o,
        tova,
        snapkv,
        rkv,
        random,
        keydiff,
        knorm,
        curdkv,
        learned,
        vase,
        vase_dkv,
        quest,
    )
}
POLICY_NAMES: tuple[str, ...] = tuple(_MODULES)


def _value(text: str):
    low = text.lower()
    if low in ("none", "null", "off"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_policy_spec(spec: str) -> tuple[str, dict]:
    """``'snapkv:selector=sample:guard=range'`` -> ``('snapkv', {'selector': 'sample', 'guard': 'range'})``.

    A spec names a policy and, after colons, options (``none`` -> None, numbers as numbers): this is how the command
    line runs the paper's ablations, e.g. ``vase:guard=none`` (sampling only) or ``snapkv:guard=range``.

    Raises:
        ValueError: for a part that is not ``key=value``.
    """
    name, *pairs = spec.split(":")
    options = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"policy spec {spec!r}: expected name:key=value[:key=value...], got {pair!r}")
        options[key.strip()] = _value(value.strip())
    return name.strip(), options


def make_policy(name: str | Policy, **options) -> Policy:
    """Build the policy called ``name`` with ``options`` (or return ``name`` if it is already a Policy). ``name`` may
    be a spec with options, ``'snapkv:selector=sample'`` (see :func:`parse_policy_spec`).

    Raises:
        ValueError: for an unknown name (the message lists the valid ones) or an invalid option.
    """
    if isinstance(name, Policy):
        if options:
            raise ValueError("options cannot be combined with an already built Policy")
        return name
    if ":" in name:
        name, spec_options = parse_policy_spec(name)
        options = {**spec_options, **options}
    module = _MODULES.get(name)
    if module is None:
        raise ValueError(
            f"unknown policy {name!r}{did_you_mean(name, POLICY_NAMES)}; valid policies: {', '.join(POLICY_NAMES)}"
        )
    return module.build(**options)


def policy_table() -> list[tuple[str, str, str]]:
    """(name, what it keeps, source) for every policy."""
    return [(m.NAME, m.KEEPS, m.SOURCE) for m in _MODULES.values()]


__all__ = ["POLICY_NAMES", "make_policy", "parse_policy_spec", "policy_table"]
