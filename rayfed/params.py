"""Typed hyperparameters: constraint types for a method's ``Params`` fields and the check that reads them.

A field's annotation says what it accepts (``mu: NonNegative = 0.01``, ``mode: Literal["fast", "exact"]``);
:func:`hyperparameters` makes a frozen dataclass whose construction checks every field against its annotation, and
``rayfed.method.build_method`` checks a config's values the same way (coercing them as pydantic does: a YAML list
to a tuple, an int to a float). A bad value is refused in one sentence naming the field, the value and what is
allowed (``mu = -1 is invalid: must be >= 0.``). Only checks across fields stay in a class's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from annotated_types import Ge, Gt, Interval, Le, Lt
from typing_extensions import dataclass_transform  # typing's from Python 3.11

NonNegative = Annotated[float, Ge(0)]  # a weight or scale that may be 0: >= 0
Positive = Annotated[float, Gt(0)]  # a temperature, learning rate or std: > 0
Fraction = Annotated[float, Interval(gt=0, le=1)]  # a share or ratio: in (0, 1]
UnitInterval = Annotated[float, Interval(ge=0, le=1)]  # a mixing weight: in [0, 1]
AtLeastOne = Annotated[int, Ge(1)]  # a count of steps, samples, epochs, layers: >= 1
NonNegativeInt = Annotated[int, Ge(0)]  # a count where 0 means none: >= 0

__all__ = ["AtLeastOne", "Fraction", "InvalidHyperparameter", "NonNegative", "NonNegativeInt", "Positive",
           "UnitInterval", "allowed_values", "checked_values", "hyperparameters"]

# pydantic's error types that mean "the right type, outside the allowed values" (else: the wrong type)
_OUT_OF_RANGE = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "literal_error"}
_BOUNDS = ((Gt, "gt", ">"), (Ge, "ge", ">="), (Lt, "lt", "<"), (Le, "le", "<="))
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


class InvalidHyperparameter(ValueError):
    """One hyperparameter's value is not what its annotation allows: ``field = value is invalid: reason.``"""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field} = {value!r} is invalid: {reason}.")


def allowed_values(annotation: Any, *, with_kind: bool = True) -> str | None:
    """What ``annotation`` allows, in words: ``a number >= 0``, ``one of 'a', 'b'``, ``an integer >= 1 or null``
    (``with_kind=False``: a bounded number's bounds only, ``>= 0``); None where it cannot be said shortly."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        bounds = _bounds(args[1:])
        kind = allowed_values(args[0])
        if not bounds or kind is None:
            return kind
        return f"{kind} {bounds}" if with_kind else bounds
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in args)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        said = [allowed_values(a, with_kind=with_kind) for a in members]
        if None in said:
            return None
        return " or ".join(said) + (" or null" if len(members) < len(args) else "")
    return _KINDS.get(annotation)


def _bounds(metadata: tuple[Any, ...]) -> str:
    """``>= 0``, ``> 0``, ``in (0, 1]``: the bounds an annotation's metadata sets (an Interval unpacks to them)."""
    found: dict[str, Any] = {}
    for item in metadata:
        for part in item if isinstance(item, Interval) else (item,):
            for kind, name, _ in _BOUNDS:
                if isinstance(part, kind):
                    found[name] = getattr(part, name)
    lower = next(((name, found[name]) for name in ("gt", "ge") if name in found), None)
    upper = next(((name, found[name]) for name in ("lt", "le") if name in found), None)
    if lower and upper:
        return f"in {'(' if lower[0] == 'gt' else '['}{lower[1]}, {upper[1]}{')' if upper[0] == 'lt' else ']'}"
    return " and ".join(f"{symbol} {found[name]}" for _, name, symbol in _BOUNDS if name in found)


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> tuple[dict[str, Any], Any]:
    """The annotation of each field of dataclass ``cls`` and a pydantic model of them (no defaults: every value
    is given). Annotations naming what this process cannot import are left unchecked (Any)."""
    import pydantic

    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except (NameError, TypeError):
        hints = {}
    annotations = {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}
    config = pydantic.ConfigDict(arbitrary_types_allowed=True)
    model = pydantic.create_model(f"{cls.__name__}Check", __config__=config,
                                  **{name: (annotation, ...) for name, annotation in annotations.items()})
    return annotations, model


def checked_values(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (every init field of dataclass ``cls``) checked against and coerced to their annotations;
    :class:`InvalidHyperparameter` for the first that does not fit."""
    import pydantic

    annotations, model = _field_types(cls)
    try:
        checked = model(**values)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else next(iter(values), "params")
        said = allowed_values(annotations.get(name), with_kind=first["type"] not in _OUT_OF_RANGE)
        if said is not None:
            reason = f"must be {said}"
        else:  # a container or class: pydantic's words, and where inside the value
            inside = "".join(f"[{part!r}]" for part in first["loc"][1:])
            reason = first["msg"][0].lower() + first["msg"][1:] + (f" (at {name}{inside})" if inside else "")
        raise InvalidHyperparameter(name, values.get(name), reason) from None
    return {name: getattr(checked, name) for name in annotations}


_Class = TypeVar("_Class", bound=type)


@dataclass_transform(frozen_default=True)
def hyperparameters(cls: _Class) -> _Class:
    """A method's ``Params``: ``cls`` as a frozen dataclass whose construction checks every field against its
    annotation (coercing as :func:`checked_values` does) before the class's own ``__post_init__``, which is left
    the checks across fields."""
    own: Callable[[Any], None] | None = cls.__dict__.get("__post_init__")
    if own is None:  # a subclass keeps its base's checks across fields (not the base's typed check: run below)
        inherited = getattr(cls, "__post_init__", None)
        own = getattr(inherited, "across_fields", inherited)

    def __post_init__(self: Any) -> None:
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for name, value in checked_values(type(self), given).items():
            if value is not given[name]:
                object.__setattr__(self, name, value)  # frozen: the coerced value (a tuple for a list)
        if own is not None:
            own(self)

    __post_init__.across_fields = own  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__  # before dataclass(), whose __init__ calls it only if it exists
    return dataclasses.dataclass(frozen=True)(cls)
