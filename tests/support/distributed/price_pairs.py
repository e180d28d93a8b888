"""One of N gloo processes pricing a vision-language set's pairs (packing/pair_sizes.py), or the single process:
writes every pair's sizes as this process sees them to `OUT/rank{rank}-{family}.pt`.

    python tests/support/distributed/price_pairs.py RANK WORLD PORT OUT
"""

import os
import sys
from pathlib import Path

import datasets
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_vision import make_vision_processor, vision_preference_rows  # noqa: E402

from trl_padfree.packing.pair_sizes import pair_sizes  # noqa: E402
from trl_padfree.packing.vision import PaddingFreeVisionPreferenceCollator  # noqa: E402

FAMILIES = ("gemma3", "qwen2_5_vl")  # collated pair by pair; counted from image sizes
PAIRS = 13  # not a multiple of the processes: the last share is shorter


def main(rank: int, world: int, port: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    for family in FAMILIES:
        rows = vision_preference_rows(family, PAIRS, images_per_row=[1, 2], sizes=[(17, 33), (64, 64), (90, 41)])
        collator = PaddingFreeVisionPreferenceCollator(processor=make_vision_processor(family), prefix_sharing=True)
        sizes = pair_sizes(datasets.Dataset.from_list(rows), collator, rank=rank, world=world, show_progress=False)
        torch.save(sizes, out / f"rank{rank}-{family}.pt")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    datasets.disable_caching()  # the gather is under test here, not the cache
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
