"""Search spaces: ``tune.space`` parsed into Tune's parameter space and mapped back to config values."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ray import tune as ray_tune

from rayfed.errors import ConfigError, choice_error

SPACE_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
_UNSWEEPABLE = {"tune": "a sweep cannot sweep its own tune section",
                "ray": "trials share the sweep's Ray cluster",
                "tracking": "the sweep's trackers follow every trial"}


@dataclass(frozen=True)
class _Leaf:
    """One searched value: Tune's parameter ``key`` drawn from ``kind`` over ``args``."""

    key: str
    kind: str
    args: tuple[Any, ...]

    @property
    def indexed(self) -> bool:
        # Lists and mappings go to Tune (and Optuna) as indices into the values, decoded in the trial.
        return self.kind in ("grid", "choice") and not all(_is_scalar(v) for v in self.args)

    def domain(self, search: str) -> Any:
        if self.kind in ("grid", "choice"):
            values = list(range(len(self.args))) if self.indexed else list(self.args)
            if self.kind == "grid" or search == "grid":
                return ray_tune.grid_search(values)
            return ray_tune.choice(values)
        return {"uniform": ray_tune.uniform, "loguniform": ray_tune.loguniform,
                "randint": ray_tune.randint}[self.kind](*self.args)

    def decode(self, sampled: Any) -> Any:
        return self.args[sampled] if self.indexed else sampled

    def representatives(self) -> list[Any]:
        """Values checked against the config before launching: a grid/choice's all, a range's bounds and middle."""
        if self.kind in ("grid", "choice"):
            return list(self.args)
        low, high = self.args
        if self.kind == "uniform":
            return [low, (low + high) / 2, high]
        if self.kind == "loguniform":
            return [low, math.sqrt(low * high), high]
        return sorted({low, (low + high - 1) // 2, high - 1})


@dataclass(frozen=True)
class _Swept:
    """One swept config path: a single leaf, or a per-task vector of leaves and fixed values."""

    path: str
    parts: tuple[Any, ...]
    vector: bool

    @property
    def leaves(self) -> list[_Leaf]:
        return [part for part in self.parts if isinstance(part, _Leaf)]

    def value(self, params: dict[str, Any]) -> Any:
        """The config value for Tune's parameters of one trial."""
        return self._assemble({leaf.key: leaf.decode(params[leaf.key]) for leaf in self.leaves})

    def variations(self) -> Iterator[Any]:
        """Config values with every leaf's representatives in turn, the other leaves at their first."""
        first = {leaf.key: leaf.representatives()[0] for leaf in self.leaves}
        for leaf in self.leaves:
            for value in leaf.representatives():
                yield self._assemble({**first, leaf.key: value})

    def _assemble(self, leaf_values: dict[str, Any]) -> Any:
        values = [leaf_values[part.key] if isinstance(part, _Leaf) else part for part in self.parts]
        return values if self.vector else values[0]

    @property
    def log_scale(self) -> bool:
        return not self.vector and self.parts[0].kind == "loguniform"


class SearchSpace:
    """The ``tune.space`` mapping, parsed: Tune's parameter space and the mapping back to config values."""

    def __init__(self, raw: dict[str, Any], search: str):
        self.search = search
        self.swept = [_parse_swept(str(path), spec) for path, spec in raw.items()]
        for swept in self.swept:
            for leaf in swept.leaves:
                _check_leaf_for_search(swept.path, leaf, search)

    @property
    def paths(self) -> list[str]:
        return [swept.path for swept in self.swept]

    def param_space(self) -> dict[str, Any]:
        return {leaf.key: leaf.domain(self.search) for swept in self.swept for leaf in swept.leaves}

    def values(self, params: dict[str, Any]) -> dict[str, Any]:
        """Config path -> value for one trial's Tune parameters."""
        return {swept.path: swept.value(params) for swept in self.swept}

    def first_values(self) -> dict[str, Any]:
        return {swept.path: next(swept.variations()) for swept in self.swept}

    def log_scale(self, path: str) -> bool:
        return next(swept for swept in self.swept if swept.path == path).log_scale


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _parse_swept(path: str, spec: Any) -> _Swept:
    where = f"tune.space.{path}"
    keys = path.split(".")
    if not all(keys):
        raise ConfigError(f"{where} is not a dotted config path like train.lr or methods.0.margins.")
    if keys[0] in _UNSWEEPABLE:
        raise ConfigError(f"{where}: the {keys[0]} section cannot be swept ({_UNSWEEPABLE[keys[0]]}).")
    if isinstance(spec, list):
        if not spec:
            raise ConfigError(f"{where} = [] is an empty per-task vector; give one search space or value per task.")
        parts = tuple(
            _parse_leaf(f"{path}.{index}", element, f"{where}[{index}]") if isinstance(element, dict) else element
            for index, element in enumerate(spec)
        )
        if not any(isinstance(part, _Leaf) for part in parts):
            raise ConfigError(
                f"{where} = {spec!r} holds no search space; put fixed values in the config itself, "
                "or write an element as e.g. {uniform: [0.0, 0.1]}."
            )
        return _Swept(path, parts, vector=True)
    if isinstance(spec, dict):
        return _Swept(path, (_parse_leaf(path, spec, where),), vector=False)
    raise ConfigError(
        f"{where} = {spec!r} is not a search space; write one of {', '.join(f'{{{k}: ...}}' for k in SPACE_KINDS)}, "
        "or a list of those and fixed values for a per-task vector."
    )


def _parse_leaf(key: str, spec: dict[str, Any], where: str) -> _Leaf:
    if len(spec) != 1:
        raise ConfigError(
            f"{where} = {spec!r} must have exactly one of {', '.join(SPACE_KINDS)} (e.g. {{choice: [1, 2]}})."
        )
    kind, args = next(iter(spec.items()))
    if kind not in SPACE_KINDS:
        raise choice_error(where, kind, SPACE_KINDS)
    if kind in ("grid", "choice"):
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}.{kind} = {args!r} must be a non-empty list of values.")
        return _Leaf(key, kind, tuple(args))
    numeric = isinstance(args, list) and len(args) == 2 and all(
        isinstance(a, (int, float)) and not isinstance(a, bool) for a in args
    )
    if not numeric:
        raise ConfigError(f"{where}.{kind} = {args!r} must be [low, high], two numbers.")
    low, high = args
    if not low < high:
        raise ConfigError(f"{where}.{kind} = {args!r} needs low < high.")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}.loguniform = {args!r} needs low > 0 (a log scale has no zero).")
    if kind == "randint" and not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{where}.randint = {args!r} needs integer bounds.")
    return _Leaf(key, kind, (low, high))


def _check_leaf_for_search(path: str, leaf: _Leaf, search: str) -> None:
    if search == "grid" and leaf.kind not in ("grid", "choice"):
        raise ConfigError(
            f"tune.space.{path} is {leaf.kind}, which grid search cannot enumerate; use grid or choice values, "
            "or tune.search: random."
        )
    if search == "optuna" and leaf.kind == "grid":
        raise ConfigError(
            f"tune.space.{path} is a grid, which Optuna does not search; use choice with tune.search: optuna."
        )
