"""One vector per windowed text, from its windows' vectors as assembly reads them in order
(``--pool mean`` or ``weighted``): written beside the windows' own rows (``texts.npy``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class TextPooler:
    """One vector per text from its windows' (which come together, in order): their mean, or their
    mean weighted by each window's tokens; scaled to unit length where the run's vectors are."""

    def __init__(self, pool: str, normalize: bool, write: Callable[[list[Any], Any], None]) -> None:
        self.pool, self.normalize, self.write = pool, normalize, write
        self._id: Any = None
        self._sum: Any = None
        self._weight = 0.0
        self.texts = 0

    def add(self, ids: list[dict[str, Any]], block: Any) -> None:
        for rid, row in zip(ids, block, strict=True):
            if self._sum is not None and rid["id"] != self._id:
                self._emit()
            weight = float(rid["tokens"]) if self.pool == "weighted" else 1.0
            if self._sum is None:
                self._id, self._sum, self._weight = rid["id"], np.zeros(len(row), dtype=np.float64), 0.0
            self._sum += weight * np.asarray(row, dtype=np.float64)
            self._weight += weight

    def _emit(self) -> None:
        vector = self._sum / max(self._weight, 1e-12)
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        self.write([self._id], vector.astype(np.float32)[None, :])
        self.texts += 1
        self._sum = None

    def finish(self) -> int:
        if self._sum is not None:
            self._emit()
        return self.texts
