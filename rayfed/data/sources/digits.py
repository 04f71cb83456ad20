"""scikit-learn's handwritten digits."""

from __future__ import annotations

import numpy as np

from rayfed.data.sources.common import require_no_group_column, _require_no_options, require_no_split
from rayfed.data.sources.dataset import ArrayDataset, SourceRequest
from rayfed.registry import register_source


@register_source("sklearn:digits")
def _load_digits(request: SourceRequest) -> ArrayDataset:
    """scikit-learn's 1,797 8x8 handwritten digits, 10 classes."""
    from sklearn.datasets import load_digits

    _require_no_options(request)
    require_no_split(request.name, request.config.split)
    require_no_group_column(request.name, request.config.partition.column)
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    return ArrayDataset(images, digits.target.astype(np.int64), tuple(str(d) for d in range(10)))
