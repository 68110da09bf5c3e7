"""The eviction algorithm, importable with torch alone (no transformers, no engine).

* :mod:`vase.core.policy` and :mod:`vase.core.policies`: a policy = scorer + optional value guard + selector, one
  module per policy (VaSE, VaSE-DKV, StreamingLLM, H2O, TOVA, SnapKV, R-KV, KeyDiff, knorm, CurDKV, random, full,
  Quest);
* :mod:`vase.core.scoring` (scorers), :mod:`vase.core.selection` (guards, selectors, the selection),
  :mod:`vase.core.budgets` (AdaKV / PyramidKV counts), :mod:`vase.core.pages` (Quest's page selection),
  :mod:`vase.core.rng` (counter-based randomness), :mod:`vase.core.masks`;
* :mod:`vase.core.config`: :class:`VaseConfig`, the user's options resolved and validated once;
* :mod:`vase.core.evict`: :func:`evict_layer`, one layer's choice for the rows that evict;
* the sequence model every integration runs (:mod:`vase.core.sequence`, :class:`Sequences`): the schedule
  (:mod:`vase.core.schedule`), the row tables (:mod:`vase.core.tables`), the query ring (:mod:`vase.core.ring`), and
  the one call of an eviction, :meth:`Sequences.evict`.
"""

from .config import VaseConfig
from .evict import LayerEviction, evict_layer, gather_kept
from .policies import POLICY_NAMES, make_policy, parse_policy_spec, policy_table
from .policy import Policy
from .sequence import Sequences

__all__ = [
    "POLICY_NAMES",
    "LayerEviction",
    "Policy",
    "Sequences",
    "VaseConfig",
    "evict_layer",
    "gather_kept",
    "make_policy",
    "parse_policy_spec",
    "policy_table",
]
