"""Measure how every rank of a split row gets the row's micro-batches, on CPU, one round at a time, and check it.

Run from the repository root, on a quiet machine:

    python3 tools/measure/measure_batch_hand_out.py --output docs/bench/batch_hand_out_cpu.json

`--ranks` gloo processes (one CPU thread each), each with its own collated micro-batch, as each rank's dataloader
yields it: a text batch (`PaddingFreePreferenceCollator`, prefix sharing on, reference log-probs included) and a
vision-language batch (Qwen2.5-VL's processor on `--images` noise images of `--image-size` pixels per prompt,
`pixel_values` included). One round is every rank getting every rank's batch; medians of `--repeats` after a warm-up,
timed as the slowest rank's:

- tensors: `parallel/batch_hand_out.py` (two all-gathers, the headers read on the host);
- pickled: `all_gather_object` of the whole batch, as before;
- recollated: the alternative of gathering each rank's dataset indices (one int64 all-gather) and collating the other
  ranks' micro-batches again from their examples (the processor's image processing included; the images already
  decoded in memory, so reading them from a dataset is not counted).

Every round also checks that each rank received every rank's batch bit for bit, and counts what the tensor round asks
of torch.distributed (object and tensor collectives) and of the host (tests/support/host_reads.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))  # the tests' helpers

from host_reads import HostReads  # noqa: E402

from trl_padfree.cli.bench.report import run_provenance
from trl_padfree.packing.collator import PaddingFreePreferenceCollator  # noqa: E402
from trl_padfree.parallel.batch_hand_out import exchanged_batches  # noqa: E402
from trl_padfree.parallel.groups import RowGroup  # noqa: E402

COUNTED = ("all_gather_object", "broadcast_object_list", "all_gather", "all_gather_into_tensor", "all_gather_single",
           "broadcast")  # fmt: skip


def text_examples(rank: int, pairs: int) -> list[dict]:
    rng = random.Random(rank)
    examples = []
    for _ in range(pairs):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 60))]
        examples.append({
            "prompt_ids": prompt, "chosen_ids": [rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))],
            "rejected_ids": [rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))],
            "ref_chosen_logps": -rng.random() * 50, "ref_rejected_logps": -rng.random() * 50,
        })  # fmt: skip
    return examples


def builders(options):
    """Per kind: (the examples of a rank's micro-batch, the collator), the same in every process for a rank."""
    from tiny_vision import make_vision_processor, vision_preference_rows

    from trl_padfree.packing.vision import PaddingFreeVisionPreferenceCollator

    pixels = options.image_size**2
    processor = make_vision_processor("qwen2_5_vl", min_pixels=pixels, max_pixels=pixels)
    vision_collator = PaddingFreeVisionPreferenceCollator(processor)
    size = [(options.image_size, options.image_size)]
    return {
        "text": (
            lambda rank: text_examples(rank, options.pairs),
            PaddingFreePreferenceCollator(pad_token_id=0, prefix_sharing=True),
        ),
        "vision": (
            lambda rank: vision_preference_rows("qwen2_5_vl", options.pairs, rank, options.images, size),
            vision_collator,
        ),
    }


def assert_same(received, expected, where="batch") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(received, torch.Tensor) and received.dtype == expected.dtype, where
        assert received.shape == expected.shape and torch.equal(received, expected), where
    elif isinstance(expected, dict):
        assert isinstance(received, dict) and list(received) == list(expected), where
        for key in expected:
            assert_same(received[key], expected[key], f"{where}[{key!r}]")
    else:
        assert type(received) is type(expected) and received == expected, (where, received, expected)


def slowest(seconds: float) -> float:
    everyone = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    dist.all_gather_into_tensor(everyone, torch.tensor([seconds], dtype=torch.float64))
    return everyone.max().item()


def timed(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        function()
        times.append(slowest(time.perf_counter() - start))
    return statistics.median(times)


def counted_round(function) -> dict:
    """The collectives and host reads of one call of `function`."""
    calls = {}

    def counting(name, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return wrapper

    originals = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}
    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        with HostReads() as reads:
            function()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"collectives": calls, "host_reads": reads.count}


def worker(rank: int, ranks: int, options, init_file: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks)
    group = RowGroup(dist.group.WORLD, rank, ranks)
    cpu = torch.device("cpu")
    report = {}
    for kind, (examples_of, collator) in builders(options).items():
        everyone = [collator(examples_of(other)) for other in range(ranks)]  # what each rank's dataloader yields
        batch = everyone[rank]
        for received, expected in zip(exchanged_batches(batch, group, cpu), everyone, strict=True):
            assert_same(received, expected)
        pixel_bytes = sum(value.nbytes for value in batch.get("image_inputs", {}).values())
        entry = {
            "tensors": counted_round(lambda batch=batch: exchanged_batches(batch, group, cpu)),
            "tensor_bytes": sum(value.nbytes for value in batch.values() if torch.is_tensor(value)) + pixel_bytes,
        }
        if options.repeats:
            examples = examples_of(rank)

            def pickled(batch=batch):
                gathered = [None] * ranks
                dist.all_gather_object(gathered, batch)

            def recollated(examples=examples, collator=collator):
                indices = torch.zeros(ranks * options.pairs, dtype=torch.int64)
                dist.all_gather_into_tensor(indices, torch.arange(options.pairs))
                for _ in range(ranks - 1):  # the other ranks' micro-batches, collated here again
                    collator([dict(example) for example in examples])  # TRL's collator rewrites the prompt

            entry["seconds"] = {
                "tensors": timed(lambda batch=batch: exchanged_batches(batch, group, cpu), options.repeats),
                "pickled": timed(pickled, options.repeats),
                "recollated": timed(recollated, options.repeats),
                "collate_one": timed(
                    lambda examples=examples, collator=collator: collator([dict(example) for example in examples]),
                    options.repeats,
                ),
            }
        report[kind] = entry
    if rank == 0:
        results.put(report)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=4, help="pairs per micro-batch")
    parser.add_argument("--images", type=int, default=2, help="images per prompt")
    parser.add_argument("--image-size", type=int, default=224, help="pixels per side")
    parser.add_argument("--repeats", type=int, default=5, help="0: check and count only")
    parser.add_argument("--output")
    options = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        workers = [
            context.Process(target=worker, args=(rank, options.ranks, options, f"{scratch}/init", results))
            for rank in range(options.ranks)
        ]
        for process in workers:
            process.start()
        for process in workers:
            process.join()
        if any(process.exitcode for process in workers):
            raise SystemExit(f"a rank failed: exit codes {[process.exitcode for process in workers]}")
        report = results.get(timeout=10)
    command = ["python", "tools/measure/measure_batch_hand_out.py", *(argv if argv is not None else sys.argv[1:])]
    result = {
        "provenance": run_provenance(vars(options), shlex.join(command)),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": 1,
        "cores": os.cpu_count(),
        "ranks": options.ranks,
        "pairs": options.pairs,
        "images_per_prompt": options.images,
        "image_size": options.image_size,
        **report,
    }
    print(json.dumps(result, indent=1))
    if options.output:
        Path(options.output).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
