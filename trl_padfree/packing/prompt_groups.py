"""Prompt groups: the pairs of one prompt in the same micro-batch, so that the batch can compute the prompt once.

`PromptGroupBatchSampler` yields TRL's batches, `batch_size` pairs each (the last one shorter unless `drop_last`),
every pair once per epoch, with a prompt's pairs together wherever the batch sizes allow. A group is the pairs sharing
a group id (`prompt_id` of `data.scored_pairs`, or the tokenized prompt). Each epoch:

    pairs (id)          0:a 1:a 2:a 3:b 4:c 5:c 6:d 7:d 8:d 9:d 10:d 11:d 12:e 13:e        batch_size 4
    groups, shuffled    d:6  a:3  e:2  c:2  b:1
    cut to fit          d:4 as a whole batch | pieces d:2  a:3  e:2  c:2  b:1
    best fit, largest   [a a a b]  [d d e e]  [c c]            full bins are batches
    short bins, cut     [c c] laid end to end and cut every 4 pairs: here the epoch's last, short batch
    batches             [d d d d] [a a a b] [d d e e] shuffled, then [c c]

A group larger than a batch fills whole batches and leaves a piece; pieces go largest first into the fullest bin that
holds them (best-fit decreasing; equal sizes in the shuffled order). Where whole groups cannot fill every batch
exactly (groups of 3 in batches of 4), the bins left short are laid end to end and cut every `batch_size` pairs: each
such cut splits one group in two consecutive batches, and costs one more computation of its prompt. Only there is a
group that fits a batch split, so never when the group sizes divide each other and `batch_size` (K completions paired
the same way for every prompt: `all_pairs` of K = 4 is 6 pairs, so batches of 6, 12, ...).

`prompt_groups` finds the groups within one batch, for the collator: the pairs whose prompts are token-identical;
`dataset_group_ids` gives a training set's pairs their group ids, for the samplers (`units.PairUnits` groups them).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import deque
from collections.abc import Hashable, Iterator, Sequence

import torch
from torch.utils.data import Sampler

from .units import PairUnits


def prompt_groups(prompt_ids: Sequence[Sequence[int]], keys: Sequence[Hashable] | None = None) -> list[list[int]]:
    """The positions of a batch's pairs grouped by token-identical prompt (and equal `keys`, where given: what else
    must match for two prompts to be one, e.g. a digest of their images), groups in order of first appearance.

    >>> prompt_groups([[5, 6], [7], [5, 6], [5, 6, 7], [7]])
    [[0, 2], [1, 4], [3]]
    >>> prompt_groups([[5, 6], [5, 6]], keys=["cat.png", "dog.png"])  # same tokens, other images
    [[0], [1]]
    """
    if keys is not None and len(keys) != len(prompt_ids):
        raise ValueError(f"{len(keys)} keys for {len(prompt_ids)} prompts: give one key per pair.")
    groups: dict[tuple, list[int]] = {}
    for position, prompt in enumerate(prompt_ids):
        key = (tuple(prompt), keys[position] if keys is not None else None)
        groups.setdefault(key, []).append(position)
    return list(groups.values())


def pack_prompt_groups(groups: Sequence[Sequence[int]], batch_size: int) -> tuple[list[list[int]], list[int]]:
    """Batches of exactly `batch_size` pairs from groups of pair indices, in the order of the module's docstring:
    whole batches of groups larger than a batch, then best-fit decreasing bins of the rest; the pairs of the bins left
    short come back apart, in bin order, for the caller to cut. Returns `(full batches, pairs of the short bins)`.

    >>> pack_prompt_groups([[0, 1, 2], [3], [4, 5, 6, 7, 8], [9, 10], [11]], batch_size=4)
    ([[4, 5, 6, 7], [0, 1, 2, 3], [9, 10, 8, 11]], [])
    >>> pack_prompt_groups([[0, 1, 2], [3, 4, 5], [6, 7, 8]], batch_size=4)  # 9 pairs: no group can fill a batch
    ([], [0, 1, 2, 3, 4, 5, 6, 7, 8])
    """
    full, pieces = [], []
    for group in groups:
        whole = len(group) - len(group) % batch_size
        full.extend(list(group[start : start + batch_size]) for start in range(0, whole, batch_size))
        if whole < len(group):
            pieces.append(list(group[whole:]))
    # open_bins[room]: the bins with `room` pairs left, oldest first; a piece goes to the fullest one that holds it
    open_bins: list[deque[list[int]]] = [deque() for _ in range(batch_size)]
    opened: list[list[int]] = []
    for piece in sorted(pieces, key=len, reverse=True):  # stable: equal sizes keep their order
        room = next((room for room in range(len(piece), batch_size) if open_bins[room]), None)
        if room is None:
            batch, room = [], batch_size
            opened.append(batch)
        else:
            batch = open_bins[room].popleft()
        batch.extend(piece)
        if room > len(piece):
            open_bins[room - len(piece)].append(batch)
    full.extend(batch for batch in opened if len(batch) == batch_size)
    return full, [index for batch in opened if len(batch) < batch_size for index in batch]


class PromptGroupBatchSampler(Sampler[list[int]]):
    """Yields batches of pair indices (`batch_size` each, the epoch's last shorter unless `drop_last`) that keep the
    pairs of one group together wherever the batch sizes allow: the module's docstring shows how. Every pair comes
    once per epoch (but those of a short last batch under `drop_last`); `set_epoch` reshuffles, from `seed` and the
    epoch alone.

    Args:
        units (`PairUnits`):
            The pairs in their groups (`PairUnits.by_group_id` of each pair's prompt id, or its prompt's tokens).
        batch_size (`int`):
            Pairs per batch: `per_device_train_batch_size`, as TRL's sampler deals them.
        shuffle (`bool`, *optional*, defaults to `True`):
            Shuffle the groups and the batches each epoch; otherwise groups in order of first appearance.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the shuffle (`data_seed`, else `seed`).
        drop_last (`bool`, *optional*, defaults to `False`):
            Drop the epoch's last batch when it is short (`dataloader_drop_last`).

    >>> units = PairUnits.by_group_id(["a", "a", "b", "c", "c", "c", "b"])
    >>> sampler = PromptGroupBatchSampler(units, batch_size=4, shuffle=False)
    >>> list(sampler)
    [[0, 1, 2, 6], [3, 4, 5]]
    """

    def __init__(
        self,
        units: PairUnits,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        if len(units) == 0:
            raise ValueError("PromptGroupBatchSampler got no pairs: the training set is empty.")
        self.groups = units.units
        self.pairs, self.batch_size = len(units), batch_size
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.pairs // self.batch_size
        return -(-self.pairs // self.batch_size)

    def epoch_batches(self) -> list[list[int]]:
        """This epoch's batches, in the order they are yielded."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        groups = self.groups
        if self.shuffle:
            groups = [groups[number] for number in torch.randperm(len(groups), generator=generator).tolist()]
        full, rest = pack_prompt_groups(groups, self.batch_size)
        full.extend(rest[start : start + self.batch_size] for start in range(0, len(rest), self.batch_size))
        short = [full.pop()] if len(full[-1]) < self.batch_size else []
        if self.shuffle:
            full = [full[number] for number in torch.randperm(len(full), generator=generator).tolist()]
        return full if self.drop_last else full + short

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.epoch_batches()


def dataset_group_ids(dataset, images: bool) -> list[bytes]:
    """Each training pair's prompt group id: `vision_prompt_group_ids` for a vision-language set (tokenized only when
    collated), else `prompt_group_ids`."""
    return vision_prompt_group_ids(dataset) if images else prompt_group_ids(dataset)


def prompt_group_ids(dataset, chunk: int = 1000) -> list[bytes]:
    """Each pair's group id: a digest of its tokenized prompt (TRL's `prompt_ids`, before the collator truncates), so
    that pairs whose prompts tokenize the same are one group, in 16 bytes whatever the prompt's length. The collator
    finds the prompts it can share within a batch from the tokens themselves; these ids only bring them together."""
    ids = []
    for batch in dataset.select_columns(["prompt_ids"]).iter(batch_size=chunk):
        for prompt in batch["prompt_ids"]:
            ids.append(hashlib.blake2b(array("q", prompt).tobytes(), digest_size=16).digest())
    return ids


def vision_prompt_group_ids(dataset, chunk: int = 100) -> list[bytes]:
    """Each vision-language pair's group id (the set is tokenized only when collated): a digest of its prompt (text,
    or messages serialized with sorted keys) and of its images (each one's mode, size and pixel bytes), so that pairs
    of the same prompt on the same images are one group. The collator groups by the tokens and image inputs
    themselves; these ids only bring the pairs together."""
    columns = ["prompt", *(column for column in ("image", "images") if column in dataset.column_names)]
    ids = []
    for batch in dataset.select_columns(columns).iter(batch_size=chunk):
        for index, prompt in enumerate(batch["prompt"]):
            digest = hashlib.blake2b(digest_size=16)
            digest.update(json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str).encode())
            images = batch["images"][index] if "images" in batch else [batch["image"][index]]
            for image in images or []:
                digest.update(_image_bytes(image))
            ids.append(digest.digest())
    return ids


def _image_bytes(image) -> bytes:
    """What tells an image from another: a PIL image's mode, size and pixels; an array's shape, type and values;
    anything else (a path, a URL) as written."""
    if image is None:
        return b"none;"
    if hasattr(image, "mode") and hasattr(image, "tobytes"):  # PIL
        return f"{image.mode}{image.size};".encode() + image.tobytes()
    if hasattr(image, "tobytes") and hasattr(image, "shape"):  # numpy
        return f"{image.shape}{image.dtype};".encode() + image.tobytes()
    return f"{image!r};".encode()


def extra_prompt_computations(groups: list[list[int]], batches: list[list[int]], batch_size: int) -> int:
    """How many more batches hold a prompt's pairs than the fewest that could (a batch per `batch_size` pairs):
    the prompt computations lost to groups cut across batches."""
    batch_of = {index: number for number, batch in enumerate(batches) for index in batch}
    spans = [len({batch_of[index] for index in group if index in batch_of}) for group in groups]
    return sum(max(0, span - -(-len(group) // batch_size)) for span, group in zip(spans, groups, strict=True))
