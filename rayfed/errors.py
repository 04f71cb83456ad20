"""The one error type users see for bad input: a single sentence naming the field."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """Invalid configuration, data or checkpoint; the message is one sentence."""


def suggest(value: str, allowed: Iterable[str]) -> str:
    """Return ` (did you mean 'x'?)` for a close match of ``value`` in ``allowed``, else ``''``."""
    matches = difflib.get_close_matches(str(value), list(allowed), n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def choice_error(field: str, value: object, allowed: Iterable[str]) -> ConfigError:
    allowed = sorted(allowed)
    return ConfigError(
        f"{field} = {value!r} is not known{suggest(str(value), allowed)}; "
        f"allowed: {', '.join(allowed)}."
    )
