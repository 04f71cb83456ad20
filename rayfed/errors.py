"""The one error type users see for bad input: a single sentence naming the field."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


class ConfigError(ValueError):
    """Invalid configuration, data or checkpoint; the message is one sentence."""


_RAISED_IN = "rayfed: raised in "


@contextmanager
def raised_in(where: str) -> Iterator[None]:
    """Mark an error of user code run within (a method's hook, a source, a backbone, a task kind) with ``where``
    it ran, e.g. ``"Ditto.local_update for client 3 in round 2"``: a note under the error's message, which Ray's
    traceback of an actor keeps. A :class:`ConfigError`'s sentence says what is wrong already; of nested
    contexts, the innermost names the place."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:
        if not any(note.startswith(_RAISED_IN) for note in getattr(err, "__notes__", ())):
            err.__notes__ = [*getattr(err, "__notes__", ()), _RAISED_IN + where]  # add_note, before Python 3.11
        raise


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
