"""What balanced batches and token budgets need of each vision-language pair, priced once per dataset.

A vision-language set is tokenized only when collated (TRL runs the processor on each batch), so a pair's row is
known only by collating it. Balancing prices each pair (`row_cost`), the token budget measures it (its real tokens);
both read the same four host integers of the pair collated alone, its `PairSizes` row:

    | prompt + chosen (chosen_tokens)   | rejected branch |      shared_prefix: prompt tokens the rejected branch
                                  prompt + rejected (rejected_tokens)     reads instead (0: laid out unshared)
    scored_tokens: completion tokens of both; real tokens = chosen_tokens + rejected_tokens - shared_prefix

How they are found, cheapest first:

1. **Cache.** A file keyed by the dataset's fingerprint, the processor (class, configuration, tokenizer, chat
   templates), the collator's settings and the library versions; the key is stored in the file and a checksum of
   the sizes with it, so a file of another dataset, processor or setting, or a damaged one, is recomputed (logged),
   never used. It lies in the HF datasets cache, next to the dataset's own cache files when it has some
   (`load_dataset`'s), else in `datasets.config.HF_DATASETS_CACHE`: the sizes belong to the data and the processor,
   not to one run, so a resumed run, a second run with another `output_dir` or learning rate, and every node that
   shares the cache read them. `datasets.disable_caching()` turns it off, as it does for `map`.
2. **Shares.** Otherwise each of the N processes prices a contiguous 1/N of the pairs, and one `all_gather` of
   fixed-size int64 tensors hands every process all of them (every process then builds the same batches).
3. **Image sizes.** Where the processor writes an image as `n` copies of its placeholder token and transformers
   computes `n` from the image's height and width (`integrations.transformers.image_token_counts`: Qwen2-VL,
   Qwen2.5-VL, Qwen3-VL, LLaVA), a pair is tokenized as TRL's collator tokenizes it, without image processing, and
   its placeholders expanded to their counts; the row is then laid out by the collator's own `pack_vision_batch`.
   The first pair of each share is also collated, and a difference is refused. Other processors collate each pair.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.distributed as dist
import transformers
import trl
from tqdm.auto import tqdm

from ..costs.flops import DecoderShape
from ..integrations.transformers import counts_image_tokens_from_sizes, image_token_counts
from ..integrations.trl import apply_chat_template, is_conversational, prepare_multimodal_messages
from ..refusals.token_budget import check_counted_pair_sizes
from .balance import pair_cost
from .layout import HOST_ROW
from .vision import image_token_id_of, pack_vision_batch

logger = logging.getLogger(__name__)

FIELDS = ("chosen_tokens", "rejected_tokens", "shared_prefix", "scored_tokens")  # a pair's row of `PairSizes`
CACHE_FORMAT = 1  # bump when what a file holds, or how a pair is laid out (pack_vision_batch), changes


# ---------------------------------------------------------------------------------------------------------------------
# One pair


def sizes_of_row(row: dict[str, Any]) -> list[int]:
    """A one-pair collated row's `FIELDS`."""
    host = row[HOST_ROW]
    return [host.seq_lens[0], host.seq_lens[1], host.prefix_lens[1], host.scored_tokens]


def collated_sizes(example: dict[str, Any], collator) -> list[int]:
    # A copy: TRL's collator rewrites the example's keys (templated messages, `image` into `images`)
    return sizes_of_row(collator([dict(example)]))


def _pil_sizes(images) -> list[tuple[int, int]] | None:
    """(height, width) of each image, or None where one is not a PIL image (a path, an array: collate instead)."""
    sizes = []
    for image in images:
        if not (hasattr(image, "height") and hasattr(image, "width") and hasattr(image, "getbands")):
            return None
        sizes.append((image.height, image.width))
    return sizes


def counted_sizes(example: dict[str, Any], collator) -> list[int] | None:
    """A pair's `FIELDS` from its text and its images' sizes, without image processing: TRL's collator's templating
    and tokenization (`DataCollatorForVisionPreference.torch_call`), each image's placeholder repeated as many times
    as the processor would, then `pack_vision_batch` as the padding-free collator calls it. None where the images are
    not PIL images."""
    processor = collator.processor
    images = [example["image"]] if "image" in example else list(example.get("images") or [])
    sizes = _pil_sizes(images)
    if sizes is None:
        return None
    example = dict(example)
    if is_conversational(example):
        example["prompt"] = prepare_multimodal_messages(example["prompt"], images=images)
        example["chosen"] = prepare_multimodal_messages(example["chosen"])
        example["rejected"] = prepare_multimodal_messages(example["rejected"])
        example = apply_chat_template(example, processor)
    tokenizer = processor.tokenizer

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    placeholder = processor.image_token_id
    counts = iter(image_token_counts(processor, sizes))
    prompt = []
    for token in ids(example["prompt"]):
        prompt += [token] * next(counts) if token == placeholder else [token]
    completions = [ids(example["chosen"]), ids(example["rejected"])]
    rows = [prompt + completion for completion in completions]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id or tokenizer.eos_token_id or 0
    padded = {
        "input_ids": torch.tensor([row + [pad] * (width - len(row)) for row in rows]),
        "attention_mask": torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows]),
        "completion_mask": torch.tensor(
            [[0] * len(prompt) + [1] * len(c) + [0] * (width - len(prompt) - len(c)) for c in completions]
        ),
    }
    row = pack_vision_batch(
        padded,
        [len(images)] * 2,
        collator.image_token_id if collator.image_token_id is not None else image_token_id_of(processor),
        max_length=collator.max_length,
        pad_token_id=pad,
        pad_to_multiple_of=collator.pad_to_multiple_of,
        prefix_sharing=collator.prefix_sharing,
        prefix_sharing_min_prompt_tokens=collator.prefix_sharing_min_prompt_tokens,
    )
    return sizes_of_row(row)


def share_sizes(dataset, first: int, end: int, collator, show_progress: bool = False, desc: str = "") -> torch.Tensor:
    """`FIELDS` of pairs `first` to `end` (exclusive), `(end - first, 4)` int64: counted from image sizes where the
    processor allows it (the share's first pair also collated, and the two compared), else collated."""
    counting = counts_image_tokens_from_sizes(collator.processor)
    rows = dataset.select(range(first, end)) if hasattr(dataset, "select") else (dataset[i] for i in range(first, end))
    sizes = []
    for example in tqdm(rows, total=end - first, desc=desc, unit="pair", disable=not show_progress):
        counted = counted_sizes(example, collator) if counting else None
        if counted is None:
            sizes.append(collated_sizes(example, collator))
            continue
        if not sizes:
            check_counted_pair_sizes(
                type(collator.processor).__name__, first, counted, collated_sizes(example, collator)
            )
        sizes.append(counted)
    return torch.tensor(sizes, dtype=torch.long).reshape(-1, len(FIELDS))


# ---------------------------------------------------------------------------------------------------------------------
# What the sizes give


def costs_of(sizes: torch.Tensor, shape: DecoderShape, reference_forward: bool) -> list[float]:
    """Each pair's `pair_cost`: the `row_cost` of the pair collated alone (the same segments, the same float)."""
    return [
        pair_cost(shape, chosen, rejected, scored, shared, reference_forward)
        for chosen, rejected, shared, scored in sizes.tolist()
    ]


def lengths_of(sizes: torch.Tensor) -> list[int]:
    """Each pair's real tokens collated alone (its row before the padding segment)."""
    return (sizes[:, 0] + sizes[:, 1] - sizes[:, 2]).tolist()


# ---------------------------------------------------------------------------------------------------------------------
# The cache


def processor_digest(processor) -> str:
    """A hash of everything of a processor that can change a row: its class, its configuration (image processor
    included), its tokenizer (vocabulary, merges, normalizer, special tokens) and chat templates."""
    hasher = hashlib.sha256(f"{type(processor).__module__}.{type(processor).__qualname__}".encode())
    hasher.update(processor.to_json_string().encode())
    tokenizer = processor.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        hasher.update(backend.to_str().encode())
    else:
        hasher.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    hasher.update(json.dumps(tokenizer.init_kwargs, sort_keys=True, default=repr).encode())
    for template in (getattr(processor, "chat_template", None), getattr(tokenizer, "chat_template", None)):
        hasher.update(json.dumps(template, sort_keys=True, default=repr).encode())
    return hasher.hexdigest()


def cache_key(dataset, collator) -> dict[str, Any] | None:
    """What the sizes depend on, or None where the dataset has no fingerprint (not a `datasets.Dataset`)."""
    fingerprint = getattr(dataset, "_fingerprint", None)
    if fingerprint is None:
        return None
    settings = {field.name: repr(getattr(collator, field.name)) for field in dataclasses.fields(collator)}
    settings.pop("processor")
    return {
        "format": CACHE_FORMAT,
        "fields": list(FIELDS),
        "dataset": fingerprint,
        "pairs": len(dataset),
        "processor": processor_digest(collator.processor),
        "collator": f"{type(collator).__module__}.{type(collator).__qualname__}",
        "settings": settings,
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "datasets": datasets.__version__,
        },
    }


def cache_path(dataset, key: dict[str, Any]) -> Path | None:
    """Where the sizes for `key` lie: beside the dataset's cache files, else in the HF datasets cache; None when
    `datasets.disable_caching()` is in force."""
    if not datasets.is_caching_enabled():
        return None
    files = getattr(dataset, "cache_files", None) or []
    folder = Path(files[0]["filename"]).parent if files else Path(datasets.config.HF_DATASETS_CACHE)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return folder / "trl_padfree_pair_sizes" / f"{name}.pt"


def _checksum(sizes: torch.Tensor) -> str:
    return hashlib.sha256(sizes.contiguous().numpy().tobytes()).hexdigest()


def read_cache(path: Path | None, key: dict[str, Any]) -> torch.Tensor | None:
    """The cached sizes for `key`, or None: no file, or a file that does not hold them (another key, a shape or
    checksum that disagrees, unreadable), which is then recomputed and overwritten."""
    if path is None or not path.exists():
        return None
    try:
        stored = torch.load(path, weights_only=True)
        sizes = stored["sizes"]
        problem = None
        if stored.get("key") != key:
            problem = "it was written for another dataset, processor or setting"
        elif sizes.dtype != torch.long or tuple(sizes.shape) != (key["pairs"], len(FIELDS)):
            problem = f"its sizes have shape {tuple(sizes.shape)}"
        elif stored.get("checksum") != _checksum(sizes):
            problem = "its checksum does not match its sizes"
    except Exception as error:  # a truncated or foreign file: any failure to read it means recomputing
        problem, sizes = f"it cannot be read ({type(error).__name__}: {error})", None
    if problem is not None:
        logger.warning("Pair sizes cache %s is not used, %s; pricing the pairs again.", path, problem)
        return None
    return sizes


def write_cache(path: Path | None, key: dict[str, Any], sizes: torch.Tensor) -> None:
    """Written to a temporary file then renamed, so a reader never sees half a file (several nodes may write the
    same file on a shared disk)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(handle)
    torch.save({"key": key, "sizes": sizes, "checksum": _checksum(sizes)}, temporary)
    os.replace(temporary, path)


# ---------------------------------------------------------------------------------------------------------------------
# Shared over the processes


def gather_shares(share: torch.Tensor, pairs: int, world: int, device: torch.device) -> torch.Tensor:
    """Every process's share, in rank order, on every process: one `all_gather` of `(ceil(pairs / world), 4)` int64
    tensors (a last share that is shorter is padded with -1, cut off after)."""
    per_rank = -(-pairs // world)
    padded = torch.full((per_rank, len(FIELDS)), -1, dtype=torch.long, device=device)
    padded[: len(share)] = share.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat(gathered)[:pairs].cpu()


def _all_agree(flag: bool, device: torch.device) -> bool:
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def pair_sizes(
    dataset,
    collator,
    *,
    rank: int = 0,
    world: int = 1,
    device: torch.device | str = "cpu",
    writer: bool = True,
    show_progress: bool = True,
    desc: str = "Pricing pairs",
) -> torch.Tensor:
    """Every pair's `FIELDS`, `(len(dataset), 4)` int64, the same on every process: from the cache where every
    process finds it, else each process pricing its share and one gather; written to the cache by `writer` (each
    node's first process)."""
    device = torch.device(device)
    pairs = len(dataset)
    key = cache_key(dataset, collator)
    path = cache_path(dataset, key) if key is not None else None
    cached = read_cache(path, key)
    distributed = world > 1
    hit = cached is not None
    if distributed:  # every process takes the same branch: a node that missed would wait in the gather forever
        hit = _all_agree(hit, device)
    if hit:
        return cached
    per_rank = -(-pairs // world)
    first, end = min(rank * per_rank, pairs), min((rank + 1) * per_rank, pairs)
    share = share_sizes(dataset, first, end, collator, show_progress, desc)
    sizes = gather_shares(share, pairs, world, device) if distributed else share
    if writer and key is not None:
        write_cache(path, key, sizes)
    return sizes


def training_set_pair_sizes(trainer, desc: str) -> torch.Tensor:
    """`pair_sizes` of `trainer`'s training set under its accelerator: each process its share, the progress bar and
    the cache file on each node's first process."""
    accelerator = trainer.accelerator
    return pair_sizes(
        trainer.train_dataset,
        trainer.data_collator,
        rank=accelerator.process_index,
        world=accelerator.num_processes,
        device=accelerator.device,
        writer=accelerator.is_local_main_process,
        show_progress=accelerator.is_local_main_process,
        desc=desc,
    )
