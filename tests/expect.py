"""What tests expect of calls that should fail with a clear error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def error_messages(error: type[BaseException], *calls: Callable[[], Any]) -> list[str]:
    """Each call's `error` message, in order; "no error" for a call that raised none (any
    other exception propagates)."""
    out = []
    for call in calls:
        try:
            call()
        except error as exc:
            out.append(str(exc))
        else:
            out.append("no error")
    return out
