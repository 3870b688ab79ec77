"""An endless, resumable, shuffled iterator over a `datasets.Dataset` of prompt rows."""
from __future__ import annotations

from typing import Any

import torch


class PromptLoader:
    """Yields rows (dicts) epoch after epoch, reshuffled per epoch from `seed + epoch`.

    `state_dict()`/`load_state_dict()` capture (epoch, position) so a resumed run sees the
    same data order as an uninterrupted one.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        if len(dataset) == 0:
            raise ValueError("PromptLoader: the dataset is empty")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def next_row(self) -> dict[str, Any]:
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._make_order()
        row = self.dataset[self._order[self.position]]
        self.position += 1
        return dict(row)

    def next_rows(self, n: int) -> list[dict[str, Any]]:
        return [self.next_row() for _ in range(n)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._make_order()
