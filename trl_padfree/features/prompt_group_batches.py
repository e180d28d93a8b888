"""`PromptGroupBatches`: the trainer's feature for `train_sampling_strategy="group_by_prompt"`, a prompt's pairs in the
same micro-batch so that prefix sharing can compute the prompt once there (the sampler: packing/prompt_groups.py).

Its batches are TRL's: `per_device_train_batch_size` pairs each (the epoch's last shorter unless
`dataloader_drop_last`), every pair once per epoch, dealt to processes whole as accelerate deals TRL's own batches. A
micro-batch's loss is TRL's mean over its pairs, so a run equals padded TRL fed the same batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array

from torch.utils.data import IterableDataset

from ..packing.prompt_groups import PromptGroupBatchSampler
from ..refusals import check_prompt_groups_setup

logger = logging.getLogger(__name__)

GROUP_BY_PROMPT = "group_by_prompt"  # the `train_sampling_strategy` value that turns it on


def wants_prompt_groups(args) -> bool:
    return getattr(args, "train_sampling_strategy", None) == GROUP_BY_PROMPT


class PromptGroupBatches:
    """What the trainer sets up for `train_sampling_strategy="group_by_prompt"`, padded or padding-free (`set_up`):
    the pairs' group ids, the refusals and the batch sampler (`sampler`)."""

    def __init__(self, sampler: PromptGroupBatchSampler):
        self.sampler = sampler

    @classmethod
    def set_up(cls, trainer) -> PromptGroupBatches | None:
        """From `trainer`'s config and tokenized training set; None unless asked for."""
        args, dataset = trainer.args, trainer.train_dataset
        if not wants_prompt_groups(args) or dataset is None:
            return None
        if getattr(args, "max_tokens_per_batch", None) is not None:  # the token budget packs whole groups itself
            return None
        sized = hasattr(dataset, "__len__") and not isinstance(dataset, IterableDataset)
        check_prompt_groups_setup(sized)
        group_ids = vision_prompt_group_ids(dataset) if trainer.is_vision_dataset else prompt_group_ids(dataset)
        sampler = PromptGroupBatchSampler(
            group_ids,
            args.per_device_train_batch_size,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            drop_last=args.dataloader_drop_last,
        )
        if trainer.accelerator.is_main_process and logger.isEnabledFor(logging.INFO):
            _log_grouping(sampler, _computes_prompts_once(trainer))
        return cls(sampler)


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


def _computes_prompts_once(trainer) -> bool:
    return trainer.padding_free_enabled and bool(getattr(trainer.data_collator, "prefix_sharing", False))


def _log_grouping(sampler: PromptGroupBatchSampler, computes_prompts_once: bool) -> None:
    logger.info(
        "group_by_prompt: %d pairs of %d prompts in batches of %d; the first epoch's batches cut prompts' pairs %d "
        "time(s), each cut one more computation of a prompt (none when the pairs per prompt divide the batch size).",
        sampler.pairs,
        len(sampler.groups),
        sampler.batch_size,
        extra_prompt_computations(sampler.groups, sampler.epoch_batches(), sampler.batch_size),
    )
    if not computes_prompts_once:
        logger.info(
            "group_by_prompt only orders the batches here: a prompt's pairs are computed once per micro-batch with "
            "padding_free=True and prefix_sharing=True (or 'auto')."
        )


def extra_prompt_computations(groups: list[list[int]], batches: list[list[int]], batch_size: int) -> int:
    """How many more batches hold a prompt's pairs than the fewest that could (a batch per `batch_size` pairs):
    the prompt computations lost to groups cut across batches."""
    batch_of = {index: number for number, batch in enumerate(batches) for index in batch}
    spans = [len({batch_of[index] for index in group if index in batch_of}) for group in groups]
    return sum(max(0, span - -(-len(group) // batch_size)) for span, group in zip(spans, groups, strict=True))
