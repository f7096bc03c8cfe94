"""The one error type of the data package."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """The data source, its contents or a data setting cannot be used.

    The message names the file (and line or row where it applies) and says what to change.
    """
