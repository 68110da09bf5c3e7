"""``python -m vase.cli``: the ``vase`` command."""

from . import main

main()
