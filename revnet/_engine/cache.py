"""A small bounded cache, shared by the analysis and the loops' forward passes."""

from __future__ import annotations

import collections
from typing import Any


class LRU:
    """A small bounded mapping; the least recently used entry goes first."""

    def __init__(self, size: int):
        self.size = size
        self.data: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Any, default: Any = None) -> Any:
        hit = self.data.get(key)
        if hit is None:
            return default
        self.data.move_to_end(key)
        return hit

    def put(self, key: Any, value: Any) -> None:
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.size:
            self.data.popitem(last=False)

    def __len__(self) -> int:
        return len(self.data)
