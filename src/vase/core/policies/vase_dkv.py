"""``vase_dkv``: leverage ``||K G||^2 * ||V G||^2`` with the Gaussian projection (rank 20) drawn afresh at every
eviction, top-k.

VaSE, arXiv 2606.03928, Sec. 3.3 (the resampled variant of CurDKV). ``preset='paper'`` (spec
``vase_dkv:preset=paper``) is the reference code's ``cur_resample_gauss``: one G per (layer, batch row) shared by all
KV heads, prompt kept dense until the first eviction.
"""

from functools import partial

from ..key_scoring import Leverage
from ..policy import Policy, compose
from .vase import resolve_preset

NAME = "vase_dkv"
SOURCE = "VaSE-DKV, arXiv 2606.03928, Sec. 3.3"
KEEPS = "sinks + recent + highest key-value leverage (projection redrawn each eviction)"
DEFAULTS = {"rank": 20, "projection": "row"}  # one G shared by the KV heads, as published (docs/RESULTS.md section 5)
PAPER = {"projection": "row", "prompt": "dense"}


def build(**options) -> Policy:
    """Build the policy with ``options`` over its defaults (see :func:`vase.make_policy`).

    Raises:
        ValueError: for an option the policy does not take, an unknown preset, or an invalid value.
    """
    return compose(
        NAME, SOURCE, KEEPS, partial(Leverage, fresh=True), DEFAULTS, resolve_preset(options, PAPER), preset=None
    )
