"""Warnings of the harness that a user must see at run time (a ratio that cannot be met, a run dominated by the
buffer), as :class:`VaseWarning`: Python's usual warnings for library users, one ``[vase] warning: ...`` line on
stderr for the command line (:func:`show_on_stderr`)."""

from __future__ import annotations

import sys
import warnings


class VaseWarning(UserWarning):
    """A measurement caveat: what was asked differs from what is measured, or the setting makes results weak."""


def warn(message: str | None) -> None:
    """Emit ``message`` as a :class:`VaseWarning` (nothing for None); Python shows each distinct message once."""
    if message:
        warnings.warn(message, VaseWarning, stacklevel=2)


def show_on_stderr() -> None:
    """Show :class:`VaseWarning` as ``[vase] warning: ...`` lines on stderr (above progress bars), other warnings as
    Python does."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, VaseWarning):
            from tqdm.auto import tqdm

            tqdm.write(f"[vase] warning: {message}", file=sys.stderr)
            return
        previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.simplefilter("default", VaseWarning)
