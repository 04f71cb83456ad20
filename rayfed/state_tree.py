"""Trees of tensors: what a state slot (or a payload) may hold, nested dicts of names to tensors or to trees.

A method keeps structure as structure (``{"h": {module: features}, "A": {module: basis}}``), never as names it
builds and parses again. The engine flattens a tree only where it needs one flat name per tensor, for checkpoints,
transport and its checks: the names along the path joined by ``/`` (:data:`PATH_SEP`), so ``{"w": {"a": t}}``
becomes ``{"w/a": t}``, the name a flat dict with a ``"w/a"`` key has. :func:`unflatten_tree` rebuilds the tree
from the paths :func:`nested_paths` recorded (a name without a recorded path stays one flat name, as before).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

PATH_SEP = "/"


def tree_leaves(tree: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Each leaf (anything but a mapping) of ``tree`` with its path of names, depth first in insertion order."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from tree_leaves(value, (*path, key))
        else:
            yield (*path, key), value


def map_tree(tree: Mapping[str, Any], leaf: Callable[[Any], Any]) -> dict[str, Any]:
    """``tree`` with each leaf replaced by ``leaf(value)``, of the same structure (plain dicts)."""
    return {key: map_tree(value, leaf) if isinstance(value, Mapping) else leaf(value) for key, value in tree.items()}


def map_levels(tree: Mapping[str, Any], level: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """``tree`` with the leaves of each level (the entries that are no mapping) replaced by ``level`` of them, the
    subtrees kept under their names: e.g. a payload's parameter names mapped level by level."""
    leaves = {key: value for key, value in tree.items() if not isinstance(value, Mapping)}
    subtrees = {key: map_levels(value, level) for key, value in tree.items() if isinstance(value, Mapping)}
    return {**level(leaves), **subtrees}


def flatten_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Each leaf of ``tree`` under its path's names joined by ``/``; a ValueError if two paths join to one name."""
    flat: dict[str, Any] = {}
    for path, value in tree_leaves(tree):
        name = PATH_SEP.join(path)
        if name in flat:
            raise ValueError(f"two entries of one tree flatten to the name {name!r}; rename one of them")
        flat[name] = value
    return flat


def nested_paths(tree: Mapping[str, Any]) -> list[list[str]]:
    """The paths of the leaves below ``tree``'s first level: what :func:`unflatten_tree` needs to rebuild it."""
    return [list(path) for path, _ in tree_leaves(tree) if len(path) > 1]


def unflatten_tree(flat: Mapping[str, Any], paths: Sequence[Sequence[str]] = ()) -> dict[str, Any]:
    """The tree of a :func:`flatten_tree` result, given its :func:`nested_paths`; a name no path joins to stays a
    leaf of the first level (its ``/`` part of the name)."""
    path_of = {PATH_SEP.join(path): tuple(path) for path in paths}
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        path = path_of.get(name, (name,))
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def tree_at(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    """The entry of ``tree`` at ``path`` (its names from the top)."""
    node: Any = tree
    for key in path:
        node = node[key]
    return node
