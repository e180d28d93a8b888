"""Count the bytes that the collectives of a context-parallel or Ulysses DPO run move, and compare them with the
formulas of docs/concepts/memory-planning.md (Communication).

    python count_collectives.py save-model DIR          # a tiny Llama: 8 heads, 2 KV heads, head_dim 8, 2 layers
    accelerate launch ... count_collectives.py --model DIR --output RUN.json --runs ... # tests/support/distributed/train_dpo.py
    python count_collectives.py compare RUN.json DIR     # measured (rank 0) against the formulas

Under `accelerate launch` it runs tests/support/distributed/train_dpo.py with every `torch.distributed` collective on the group
that shares a row (the context-parallel group, or DeepSpeed's sequence-parallel group) counted on the calling rank:
bytes sent to and received from the other ranks, by what moved and in which pass (the forward, the recomputation of
activation checkpointing, the backward). Run it from the repository root.
"""

import collections
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, "tests/support/distributed")
import train_dpo  # noqa: E402

import trl_padfree.modeling.packed_forward  # noqa: E402
from trl_padfree.parallel import groups as row_groups_module  # noqa: E402

BYTES = collections.Counter()  # (what, pass, "sent" | "received") -> bytes, this rank
CALLS = collections.Counter()  # (what, pass) -> collective calls
ROWS = []  # every packed forward: (row length, with gradients)


def row_groups() -> list:
    groups = [group.group for pair in row_groups_module._GROUPS.values() for group in pair if group.group is not None]
    try:
        from deepspeed.utils import groups as deepspeed_groups

        groups.append(deepspeed_groups._get_sequence_parallel_group())
    except Exception:  # no DeepSpeed, or no sequence parallelism set up yet
        pass
    return groups


def pass_of(what: str, tensor: torch.Tensor) -> str:
    # Inside autograd's backward, a tensor that requires grad is a recomputed activation, not a gradient; so are
    # position_ids, which have none
    if torch._C._current_graph_task_id() == -1:
        return "forward"
    return "recompute" if tensor.requires_grad or what == "position_ids" else "backward"


def count(what, tensor, sent, received, group) -> None:
    if not any(group is row_group for row_group in row_groups()):
        what = "other groups"  # ZeRO's own traffic: not counted against the formulas
    phase = pass_of(what, tensor)
    CALLS[what, phase] += 1
    BYTES[what, phase, "sent"] += sent
    BYTES[what, phase, "received"] += received


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def what_moved(tensor: torch.Tensor) -> str:
    if tensor.dtype == torch.int64:
        return "position_ids"
    if tensor.dim() == 4 and tensor.shape[0] == 1:
        return "keys and values"  # (1, kv_heads, T/C, 2 head_dim)
    if tensor.dim() == 5:
        return "q/k/v all-to-all"  # DeepSpeed's (N, T/N, batch, heads/N, head_dim)
    if tensor.dim() == 4:
        return "output all-to-all"  # DeepSpeed's (N, T/N, batch, heads x head_dim / N)
    return "per-token outputs"  # (1, T/C) or (1, T/C, ...) fp32


_all_gather, _scatter, _all_to_all_single, _all_to_all = (
    dist.all_gather,
    dist.scatter,
    dist.all_to_all_single,
    dist.all_to_all,
)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    others = (len(tensor_list) - 1) * nbytes(tensor)
    count(what_moved(tensor), tensor, others, others, group)
    return _all_gather(tensor_list, tensor, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    # gloo has no reduce-scatter: the backward of torch.distributed.nn's all_gather is an all-to-all and a sum, the
    # all-to-all one scatter per rank. The source keeps its own piece and sends the others; the rest receive one
    source = src if group_src is None else dist.get_global_rank(group, group_src)
    if source == dist.get_rank():
        sent = sum(nbytes(piece) for piece in scatter_list) - nbytes(tensor)
        count(what_moved(tensor), tensor, sent, 0, group)
    else:
        count(what_moved(tensor), tensor, 0, nbytes(tensor), group)
    return _scatter(tensor, scatter_list, src, group=group, async_op=async_op, group_src=group_src)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    # gloo has no reduce-scatter: the backward of trl-padfree's all-gather (parallel.groups._GatherChunks) sends
    # each rank its chunk of the gradient and sums what it receives, as many bytes as NCCL's reduce-scatter
    rank = dist.get_rank(group)
    sent = sum(nbytes(piece) for index, piece in enumerate(input_tensor_list) if index != rank)
    received = sum(nbytes(piece) for index, piece in enumerate(output_tensor_list) if index != rank)
    count(what_moved(input_tensor_list[0]), input_tensor_list[0], sent, received, group)
    return _all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    others = nbytes(input) * (dist.get_world_size(group) - 1) // dist.get_world_size(group)  # equal splits
    count(what_moved(input), input, others, others, group)
    return _all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


_run_packed = trl_padfree.modeling.packed_forward.run_packed


def run_packed(forward, packed_batch, kwargs, module=None):
    ROWS.append((packed_batch.row_length, torch.is_grad_enabled()))
    return _run_packed(forward, packed_batch, kwargs, module)


_describe = train_dpo.describe


def describe(trainer) -> dict:
    report = _describe(trainer)
    report["collectives"] = [[*key, value] for key, value in sorted(BYTES.items())]
    report["calls"] = [[*key, value] for key, value in sorted(CALLS.items())]
    report["rows"] = list(ROWS)
    return report


def compare(report_path: str, model_dir: str) -> None:
    """Measured bytes received by rank 0 against the formulas, per kind of collective and pass."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    layers, heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    for run, report in json.loads(Path(report_path).read_text()).items():
        size = max(report["context_parallel_size"], report["sequence_parallel_size"])
        b = 2 if "bf16" in run else 4
        policy = [row for row, with_grad in report["rows"] if with_grad]
        every = [row for row, _ in report["rows"]]
        checkpointing = "checkpointing" in run
        share = (size - 1) / size  # of a row, what comes from the other ranks
        if report["context_parallel_size"] > 1:
            per_row = share * 2 * kv_heads * head_dim * b * layers  # the row's keys and values, every layer
            expected = {
                ("keys and values", "forward"): per_row * sum(every),  # policy and reference forwards
                ("keys and values", "recompute"): per_row * sum(policy) if checkpointing else 0,
                ("keys and values", "backward"): per_row * sum(policy),  # the reduce-scatter
            }
        else:
            kv_sent = max(kv_heads, size)  # DeepSpeed repeats KV heads when N > kv_heads
            per_row = share / size * (2 * heads + 2 * kv_sent) * head_dim * b * layers  # q, k, v, output of T/N
            ids = (size - 1) / size * 8 * layers  # int64 position_ids of the row, all-gathered in every layer
            expected = {
                ("q/k/v all-to-all + output all-to-all", "forward"): per_row * sum(every),
                ("q/k/v all-to-all + output all-to-all", "recompute"): per_row * sum(policy) if checkpointing else 0,
                ("q/k/v all-to-all + output all-to-all", "backward"): per_row * sum(policy),
                ("position_ids", "forward"): ids * sum(every),
                ("position_ids", "recompute"): ids * sum(policy) if checkpointing else 0,
            }
        # TRL's fused LM head, gathered back per row token: the policy's log_probs, entropy, mean_logits (fp32),
        # is_top1 and label_mask (bool), 14 bytes; the reference's log_probs and label_mask, 5 bytes. Only the
        # log-probs carry a gradient back
        reference = [row for row, with_grad in report["rows"] if not with_grad]
        expected[("per-token outputs", "forward")] = share * (14 * sum(policy) + 5 * sum(reference))
        expected[("per-token outputs", "backward")] = share * 4 * sum(policy)
        measured = collections.Counter()
        for what, phase, direction, value in report["collectives"]:
            if direction == "received":
                key = "q/k/v all-to-all + output all-to-all" if "all-to-all" in what else what
                measured[key, phase] += value
        sent = {tuple(line[:2]): line[3] for line in report["collectives"] if line[2] == "sent"}
        symmetric = all(sent[tuple(line[:2])] == line[3] for line in report["collectives"] if line[2] == "received")
        print(f"\n{run}: {size} ranks, rows {every} ({len(policy)} with gradients), rank 0, bytes received")
        print(f"(bytes sent equal bytes received on every line: {symmetric})")
        print("| what | pass | measured | formula | calls |")
        print("|---|---|---|---|---|")
        calls = collections.Counter()
        for what, phase, value in report["calls"]:
            calls["q/k/v all-to-all + output all-to-all" if "all-to-all" in what else what, phase] += value
        for key in sorted(set(measured) | set(expected)):
            formula = expected.get(key)
            formula = "-" if formula is None else f"{formula:,.0f}"
            print(f"| {key[0]} | {key[1]} | {measured.get(key, 0):,} | {formula} | {calls.get(key, 0)} |")


def save_model(directory: str) -> None:
    from trl_padfree.data import load_demo_tokenizer
    from trl_padfree.tiny import make_model

    tokenizer = load_demo_tokenizer()
    shape = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2
    )
    make_model("llama", vocab_size=len(tokenizer), **shape).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


if __name__ == "__main__":
    if sys.argv[1] == "save-model":
        save_model(sys.argv[2])
    elif sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        dist.all_gather, dist.scatter, dist.all_to_all_single, dist.all_to_all = (
            all_gather,
            scatter,
            all_to_all_single,
            all_to_all,
        )
        trl_padfree.modeling.packed_forward.run_packed = run_packed
        train_dpo.describe = describe
        train_dpo.main(sys.argv[1:])
