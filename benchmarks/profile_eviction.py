"""Profile one eviction step: which part (scoring, guard, selection, compaction) costs what (= `vase bench profile`).

.venv/bin/python benchmarks/profile_eviction.py --policies vase,snapkv,rkv --budget 1024
"""

import sys

from vase.cli import app

if __name__ == "__main__":
    app(["bench", "profile", *sys.argv[1:]])
