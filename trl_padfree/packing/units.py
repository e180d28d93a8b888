"""`PairUnits`: what the batch samplers deal (token_budget.py, balanced_batches.py, prompt_groups.py).

A unit is a pair alone, or a prompt's group of pairs, which a sampler keeps in one micro-batch wherever it can. Each
pair has a size (its row's tokens, or its training step's cost); a set of one group's pairs has the size of the row
they make together (`group_size`: under prefix sharing their prompt once), by default the sum of their sizes.

    >>> units = PairUnits.by_group_id(["a", "b", "a"], sizes=[3, 4, 5])
    >>> units.units, units.size([0, 2]), units.group_numbers()
    ([[0, 2], [1]], 8, [0, 1, 0])
    >>> PairUnits([3, 4]).units
    [[0], [1]]
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class PairUnits:
    """Pairs, each sized alone (`sizes`), in prompt groups where `groups` are given (pair indices; every pair in
    one), a set of one group's pairs sized by `group_size` (default: the sum of their sizes)."""

    sizes: Sequence[float]
    groups: list[list[int]] | None = None
    group_size: Callable[[Sequence[int]], float] | None = None

    @classmethod
    def by_group_id(
        cls,
        group_ids: Sequence[Hashable],
        sizes: Sequence[float] | None = None,
        group_size: Callable[[Sequence[int]], float] | None = None,
    ) -> PairUnits:
        """The pairs of equal `group_ids` as groups, in order of first appearance (a list id is read as a tuple);
        `sizes` default to 1 per pair."""
        groups: dict[Hashable, list[int]] = {}
        for index, group_id in enumerate(group_ids):
            key = tuple(group_id) if isinstance(group_id, list) else group_id
            try:
                groups.setdefault(key, []).append(index)
            except TypeError as error:  # unhashable
                raise ValueError(f"The group id of pair {index} ({group_id!r}) cannot be a key: {error}.") from None
        return cls([1] * len(group_ids) if sizes is None else sizes, list(groups.values()), group_size)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def units(self) -> list[list[int]]:
        """Each unit's pair indices: the groups, or every pair alone."""
        return self.groups if self.groups is not None else [[index] for index in range(len(self.sizes))]

    def size(self, pairs: Sequence[int]) -> float:
        """The size of a set of one unit's pairs laid out together."""
        if self.group_size is not None:
            return self.group_size(pairs)
        return sum(self.sizes[index] for index in pairs)

    def group_numbers(self) -> list[int] | None:
        """Each pair's group (its number in `groups`); None without groups."""
        if self.groups is None:
            return None
        numbers = [0] * len(self.sizes)
        for number, group in enumerate(self.groups):
            for index in group:
                numbers[index] = number
        return numbers
