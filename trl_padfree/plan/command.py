"""Command line: the options of `trl-padfree plan` and what it runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .report import format_report, plan_to_json
from .search import make_plan
from .setup import DEFAULT_RESERVE, REFERENCE_PLACES, Setup
from .shapes import load_model_shape
from .units import BYTES_PER_PARAM, GiB, parse_count, parse_memory


def _argument(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    convert.__name__ = parse.__name__
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    memory, count = _argument(parse_memory), _argument(parse_count)
    parser.add_argument(
        "model",
        help="a local folder or config.json, a hub name (its config only), trl-padfree/<size>-<type>, or a parameter "
        "count (34.4B, 7e9, 500M)",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="default: 8")
    parser.add_argument("--nodes", type=int, default=1, metavar="N", help="default: 1")
    parser.add_argument(
        "--gpu-memory",
        type=memory,
        default=80 * GiB,
        metavar="SIZE",
        help="per GPU: 80 (GiB, the default), 80GiB, 80GB (10^9 bytes)",
    )
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=(0, 1, 2, 3),
        help="DeepSpeed ZeRO stage; 0: plain data parallelism (default: 3, none with --fsdp2)",
    )
    parser.add_argument("--offload-optimizer", action="store_true", help="DeepSpeed offload_optimizer: cpu")
    parser.add_argument(
        "--offload-param", action="store_true", help="DeepSpeed offload_param: cpu (ZeRO-3, with the optimizer)"
    )
    parser.add_argument(
        "--fsdp2",
        action="store_true",
        help="plan PyTorch FSDP2 (accelerate fsdp_version: 2) instead of DeepSpeed; not with --zero-stage or the "
        "DeepSpeed offloads",
    )
    parser.add_argument(
        "--fsdp2-offload-params",
        action="store_true",
        help="FSDP2 fsdp_offload_params: true (parameters, gradients and optimizer states in CPU memory)",
    )
    parser.add_argument("--precision", choices=tuple(BYTES_PER_PARAM), default="bf16", help="default: bf16")
    parser.add_argument(
        "--reference",
        choices=REFERENCE_PLACES,
        default="gpu",
        help="gpu (default); offload (ref_offload: true, ZeRO-3 or FSDP2); precompute (precompute_ref_log_probs: "
        "true)",
    )
    parser.add_argument(
        "--tokens",
        type=count,
        default=8192,
        metavar="T",
        help="per micro-batch: the chosen + rejected tokens of all its pairs, packed in one row, at most pairs x 2 x "
        "max_length; with --context-parallel N still the whole row, each GPU of a group running 1/N of it "
        "(default: 8192)",
    )
    parser.add_argument(
        "--context-parallel",
        type=int,
        default=1,
        metavar="N",
        help="context_parallel_size: groups of N consecutive GPUs share each packed row, attention gathering the "
        "row's keys and values; N must divide the number of GPUs (default: 1, none)",
    )
    parser.add_argument(
        "--image-tokens",
        type=count,
        default=0,
        metavar="N",
        help="of the row's tokens, those a vision-language model's images take: each GPU that shares the row "
        "encodes its share of them (default: 0)",
    )
    parser.add_argument(
        "--whole-images",
        action="store_true",
        help="deal_images=False: every GPU that shares a row encodes all of its images",
    )
    parser.add_argument(
        "--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True, help="default: on"
    )
    parser.add_argument(
        "--min-tokens", type=count, default=2048, metavar="T", help="the fewest tokens to suggest (default: 2048)"
    )
    parser.add_argument(
        "--reserve",
        type=memory,
        default=DEFAULT_RESERVE,
        metavar="SIZE",
        help="per GPU, for the CUDA context, NCCL and DeepSpeed buffers, fragmentation (default: 3 GiB)",
    )
    parser.add_argument("--cpu-memory", type=memory, metavar="SIZE", help="per node (default: not checked)")
    parser.add_argument(
        "--zero-init", action=argparse.BooleanOptionalAction, default=True, help="ZeRO-3 zero.Init (default: on)"
    )
    parser.add_argument(
        "--largest-layer", type=count, metavar="COUNT", help="parameters of the largest layer, with a parameter count"
    )
    parser.add_argument("--json", metavar="FILE", help="write the numbers (bytes) as JSON")
    parser.set_defaults(run=run)


def _zero_stage(options: argparse.Namespace) -> int | None:
    # ZeRO-3 unless told otherwise, and no stage under FSDP2: a --zero-stage given with --fsdp2 is refused, not dropped
    if options.zero_stage is None and not options.fsdp2:
        return 3
    return options.zero_stage


def run(options: argparse.Namespace) -> int:
    setup = Setup(
        gpus_per_node=options.gpus_per_node,
        nodes=options.nodes,
        gpu_memory=options.gpu_memory,
        zero_stage=_zero_stage(options),
        offload_optimizer=options.offload_optimizer,
        offload_param=options.offload_param,
        fsdp2=options.fsdp2,
        fsdp_offload_params=options.fsdp2_offload_params,
        precision=options.precision,
        reference=options.reference,
        tokens=options.tokens,
        context_parallel_size=options.context_parallel,
        image_tokens=options.image_tokens,
        deal_images=not options.whole_images,
        activation_checkpointing=options.activation_checkpointing,
        reserve=options.reserve,
        cpu_memory=options.cpu_memory,
        zero_init=options.zero_init,
    )
    if options.min_tokens < 1:
        raise ValueError("--min-tokens must be at least 1.")
    shape = load_model_shape(options.model, options.largest_layer)
    plan = make_plan(shape, setup, options.min_tokens)
    print(format_report(plan))
    if options.json:
        Path(options.json).write_text(json.dumps(plan_to_json(plan), indent=2) + "\n")
    return 0
