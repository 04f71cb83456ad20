"""What several sources share: checks of their arguments and options, group-size filtering, text columns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from rayfed.data.sources.dataset import DataError, SourceRequest
from rayfed.errors import suggest

if TYPE_CHECKING:
    from rayfed.config import DataConfig


def _group_size(config: DataConfig) -> tuple[int, int | None]:
    partition = config.partition
    return (1, None) if partition.max_group_size is None else (partition.min_samples, partition.max_group_size)

def _rows_of_sized_groups(groups: np.ndarray, group_size: tuple[int, int | None]) -> np.ndarray:
    """Indices of the samples whose group has between ``group_size[0]`` and ``group_size[1]`` samples."""
    smallest, largest = group_size
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    sizes = counts[inverse.reshape(-1)]
    return np.flatnonzero((sizes >= smallest) & (sizes <= (largest if largest is not None else sizes.max())))

def one_row_per_group(groups: np.ndarray, order: np.ndarray | None, pick: str) -> np.ndarray:
    """Sorted indices of one row for each distinct value of ``groups``: of a group's n rows ordered by ``order``
    (ties, and no order, in the rows' own order), the one at position n // 2 (``pick = "middle"``) or 0
    (``"first"``)."""
    rows = np.arange(len(groups))
    if not len(rows):
        return rows
    group_ids = np.unique(groups, return_inverse=True)[1].reshape(-1)
    ranks = () if order is None else (np.unique(order, return_inverse=True)[1].reshape(-1),)
    ordered = np.lexsort((rows, *ranks, group_ids))  # by group, then order, then row
    starts = np.flatnonzero(np.r_[True, np.diff(group_ids[ordered]) != 0])
    sizes = np.diff(np.r_[starts, len(ordered)])
    return np.sort(ordered[starts + (sizes // 2 if pick == "middle" else 0)])


def _strings(values: Any) -> np.ndarray | None:
    return None if values is None else np.asarray([str(v) for v in values], dtype=object)

def require_no_split(source: str, split: str | None) -> None:
    if split is not None:
        raise DataError(f"data.split = {split!r} is not supported for source {source!r}: it has a single split.")


def _require_group_column(source: str, group_column: str | None, only: str) -> None:
    if group_column not in (None, only):
        raise DataError(
            f"data.partition.column = {group_column!r} is not a column of {source!r}; "
            f"its only group column is {only!r}."
        )


def require_no_group_column(source: str, group_column: str | None) -> None:
    if group_column is not None:
        raise DataError(
            f"data.partition.column = {group_column!r} cannot be used with source {source!r}: it has no group column."
        )


def _require_no_options(request: SourceRequest) -> None:
    if request.config.options is not None:
        raise DataError(
            f"data.options is set but data.source = {request.name!r} takes no options; they apply to generators "
            "(synthetic, shapes, parts, multimodal:<task>) and user sources."
        )

def generator_options(
    options: dict[str, Any], defaults: dict[str, Any], source_note: str, positive_ints: tuple[str, ...]
) -> dict[str, Any]:
    """``data.options`` over a generator's defaults; unknown keys and non-positive counts are errors."""
    unknown = [key for key in options if key not in defaults]
    if unknown:
        raise DataError(
            f"data.options has no option {unknown[0]!r}{suggest(unknown[0], defaults)}{source_note}; "
            f"allowed: {', '.join(defaults)}."
        )
    params = {**defaults, **options}
    for key in positive_ints:
        if not isinstance(params[key], int) or isinstance(params[key], bool) or params[key] < 1:
            raise DataError(f"data.options.{key} = {params[key]!r} is invalid: it must be an integer >= 1.")
    return params


def non_negative(params: dict[str, Any], key: str) -> float:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise DataError(f"data.options.{key} = {value!r} is invalid: it must be a number >= 0.")
    return value
