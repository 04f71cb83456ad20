"""From YAML, a dict or overrides to a validated :class:`RunConfig`, with one sentence on the first problem; and
back to YAML."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pydantic
import yaml
from pydantic import BaseModel

from rayfed.config.fields import MOVED, clean_message
from rayfed.config.run import RunConfig, rerun_notes
from rayfed.errors import ConfigError, suggest

log = logging.getLogger("rayfed.config")


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = RunConfig
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return None
        annotation = fields[part].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _format_error(err: pydantic.ValidationError) -> str:
    first = err.errors()[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    path = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        parent = _model_at(loc[:-1]) or RunConfig
        allowed = list(parent.model_fields)
        return (
            f"unknown config field {path!r}{suggest(str(loc[-1]), allowed)}; "
            f"allowed here: {', '.join(allowed)}."
        )
    if not path or first["type"] == MOVED:  # a model-level check or a moved field: the message names its fields
        return clean_message(first["msg"]) + "."
    return f"{path} = {first.get('input')!r} is invalid: {clean_message(first['msg'])}."


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    parsed = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value.")
        try:
            parsed_value = yaml.safe_load(value)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"override {key.strip()}: the value {value!r} is not valid YAML ({problem}).") from None
        parsed.append((key.strip().split("."), parsed_value))
    return parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` items (values parsed as YAML; list items by index) into ``raw``."""
    for keys, value in parse_overrides(overrides):
        node: Any = raw
        for depth, key in enumerate(keys):
            path = ".".join(keys[: depth + 1])
            if isinstance(node, list):
                if not key.isdigit() or int(key) >= len(node):
                    raise ConfigError(f"override {path}: {key!r} is not an index below {len(node)}.")
                key = int(key)
                if isinstance(node[key], str) and depth < len(keys) - 1:
                    node[key] = {"name": node[key]}  # a method given by name only
            elif not isinstance(node, dict):
                raise ConfigError(f"override {path}: {'.'.join(keys[:depth])} is not a section.")
            if depth == len(keys) - 1:
                node[key] = value
            else:
                if isinstance(node, dict) and node.get(key) is None:
                    node[key] = {}
                node = node[key]
    return raw


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_variables(value: Any, path: str = "") -> Any:
    """``value`` with every ``${NAME}`` in its strings (at any depth) replaced by the environment variable NAME (no
    other form: a lone ``$`` stays as written); an unset variable is refused naming it and the field (``path``)."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda match: _variable(match.group(1), value, path), value)
    if isinstance(value, dict):
        return {key: expand_variables(item, f"{path}.{key}" if path else str(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(expand_variables(item, f"{path}.{index}") for index, item in enumerate(value))
    return value


def _variable(name: str, value: str, path: str) -> str:
    if name not in os.environ:
        raise ConfigError(f"{path} = {value!r} uses the environment variable {name}, which is not set; export it "
                          "(the config's comments or its docs say what it holds) before loading the config.")
    return os.environ[name]


def build_config(raw: dict[str, Any]) -> RunConfig:
    """Validate a nested dict (``${NAME}`` in its strings expanded from the environment, :func:`expand_variables`);
    raise :class:`ConfigError` with one sentence on the first problem."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, not {type(raw).__name__}.")
    try:
        return RunConfig.model_validate(expand_variables(raw))
    except pydantic.ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(
    source: str | os.PathLike | dict[str, Any] | RunConfig,
    overrides: list[str] | None = None,
) -> RunConfig:
    """Load a config from a YAML path, a dict or a RunConfig, then apply ``key=value`` overrides; ``${NAME}`` in any
    string value is the environment variable NAME, so the loaded config (and the config.yaml a run writes) holds
    its value."""
    if isinstance(source, RunConfig):
        raw = source.to_dict()
    elif isinstance(source, dict):
        raw = dict(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist.")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}".replace("\n", " ")) from None
    return build_config(apply_overrides(raw, overrides or []))


def dump_config(config: RunConfig, path: str | os.PathLike) -> None:
    """Write ``config`` as YAML; a plug-in that a rerun elsewhere cannot import gets a note (a comment on top, and a
    logged warning) saying how to make the file rerunnable."""
    from rayfed.io import atomic_write_text

    notes = rerun_notes(config)
    for note in notes:
        log.warning("%s: %s", path, note)
    comments = "".join(f"# note: {note}\n" for note in notes)
    atomic_write_text(path, comments + yaml.safe_dump(config.to_dict(), sort_keys=False))
