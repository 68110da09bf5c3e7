"""quest against the full cache and vase at 8K context: decode speed and KV memory, side by side in one process.

Four caches get the same 8,192-token prompt (the chat prompt repeated), then take turns of ``buffer`` decode steps
(as `vase bench paired`): ``full`` (transformers' DynamicCache, what a user runs without vase), ``full/static``
(vase's EvictingCache with the non-evicting ``full`` policy: the same preallocated buffers quest uses, no selection,
so quest against it is the cost or gain of the selection alone), ``vase`` and ``quest`` at the same budget. The
table gives tokens/s and the KV bytes each cache holds at the end (quest: the whole cache plus its page metadata),
with ratios to ``full``. Prints the markdown table; writes paired.json and PAIRED.md into --out.

OMP_WAIT_POLICY=PASSIVE VASE_THREADS=1 .venv/bin/python benchmarks/quest_decode.py      # budget 1024, 256 steps
.venv/bin/python benchmarks/quest_decode.py --context 2048 --steps 64 --budget 256        # quicker
"""

import argparse
import json
import os
from pathlib import Path

import torch

from vase.harness.bench_markdown import paired_markdown
from vase.harness.measure import _make_cache, paired_speed
from vase.hf.cache import EvictingCache
from vase.hf.models import load_model

STATIC = "full/static"


def make_cache(model, policy, budget, buffer):
    """``full/static``: the full policy in vase's buffers; anything else as `vase bench paired` makes it."""
    if policy == STATIC:
        return EvictingCache(model, policy="full", budget=budget, buffer=buffer)
    return _make_cache(model, policy, budget, buffer)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default=f"full,{STATIC},vase,quest", help="the first is the reference of ratios")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--buffer", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=Path("runs/quest_decode"))
    args = ap.parse_args(argv)
    if os.environ.get("VASE_THREADS"):
        torch.set_num_threads(int(os.environ["VASE_THREADS"]))
    lm = load_model(args.model)
    res = paired_speed(
        lm,
        args.policies.split(","),
        budget=args.budget,
        buffer=args.buffer,
        context=args.context,
        steps=args.steps,
        make_cache=make_cache,
    )
    res.update(model=lm.name, device=str(lm.device), threads=torch.get_num_threads())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paired.json").write_text(json.dumps(res, indent=1))
    (args.out / "PAIRED.md").write_text(paired_markdown(res))
    print(paired_markdown(res))
    return res


if __name__ == "__main__":
    main()
