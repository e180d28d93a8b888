"""Micro-batches of different pair counts, trained as one batch of the step's pairs.

Token-budget batching and balanced batches both give processes and micro-steps rows of different numbers of pairs.
TRL's loss is the mean over a micro-batch's pairs, Trainer divides it by the accumulation steps and data parallelism
averages gradients over processes: every micro-batch would count the same, whatever its pairs. Here each micro-batch's
loss is weighted by its pairs, so a step's loss and gradient are the mean over all of the step's pairs, those of
padded TRL on one batch of them; TRL's per-pair metrics are weighed the same way.
"""

from __future__ import annotations

import functools

import torch

from ..integrations.accelerate import uneven_gathers
from .balance import imbalance, row_cost
from .layout import HOST_ROW

# TRL's metrics that are means over the pairs of a micro-batch
PER_PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
# The logged estimate of how long a step waits for its slowest process: sum over micro-steps of the most expensive
# row's cost over the mean row's (1.0: every process equally busy; `packing.balance.imbalance`)
COST_RATIO_METRIC = "balance/cost_max_over_mean"


def batch_sampler_dataloader(batch_sampler, dataset, collate_fn, args, accelerator):
    """Trainer's own dataloader settings, with `batch_sampler`'s micro-batches in place of a fixed batch size; on
    every process the same micro-batches, which `accelerator.prepare` deals out round-robin."""
    from torch.utils.data import DataLoader
    from transformers.trainer_utils import seed_worker

    dataloader = DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers,
        prefetch_factor=args.dataloader_prefetch_factor,
        worker_init_fn=functools.partial(
            seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
        ),
    )
    return accelerator.prepare(dataloader)


class PairWeightedSteps:
    """The step's part of uneven micro-batches:

    count        the pairs of an optimizer step over processes, and each process's row costs, in one gather before
                 the step's first forward (`count_step`); the costs' max/mean is logged as `COST_RATIO_METRIC`
    loss         each micro-batch's loss weighted by its pairs (`weighted_loss`)
    logs         TRL's per-pair means weighted by pairs (`reweigh_metrics`)

    Args:
        accelerator: the trainer's.
        shape (`DecoderShape` or `None`): the model's, to price rows (`packing.balance.row_cost`); None logs no cost.
        reference_forward (`bool`): whether a step runs the reference model (not precomputed).
    """

    def __init__(self, accelerator, shape=None, reference_forward: bool = True):
        self.accelerator = accelerator
        self.shape = shape
        self.reference_forward = reference_forward
        self.pairs_in_step: int | None = None  # over processes, counted before the step's first forward
        self.pair_weights: list[float] = []  # pairs of each training micro-batch, over processes, since the last log
        self.cost_ratios: list[float] = []  # each step's COST_RATIO_METRIC since the last log

    def count_step(self, batch_samples: list[dict]) -> None:
        """The pairs of an optimizer step's micro-batches (Trainer fetches them all first) over processes, and the
        step's cost ratio: one gather of `1 + micro-steps` numbers per process."""
        local = [sum(len(batch[HOST_ROW].seq_lens) // 2 for batch in batch_samples)]
        if self.shape is not None:
            local += [row_cost(self.shape, batch[HOST_ROW], self.reference_forward) for batch in batch_samples]
        values = torch.tensor(local, dtype=torch.float64, device=self.accelerator.device)
        gathered = self.accelerator.gather(values).view(self.accelerator.num_processes, len(local)).tolist()
        self.pairs_in_step = round(sum(process[0] for process in gathered))
        if self.shape is not None:
            costs_by_micro_step = [list(costs) for costs in zip(*(process[1:] for process in gathered), strict=True)]
            self.cost_ratios.append(imbalance(costs_by_micro_step))

    def weighted_loss(self, compute_loss, pairs: int, accumulation_steps: int):
        """`compute_loss()` (TRL's, the mean over this micro-batch's pairs), weighted so that after Trainer divides
        it by the accumulation steps and the gradient is averaged over processes, the step's loss is the mean over
        all of the step's pairs. TRL's metric gathers accept this micro-batch's own pair count meanwhile."""
        with uneven_gathers(self.accelerator):
            result = compute_loss()
        weight = pairs * accumulation_steps * self.accelerator.num_processes / self.pairs_in_step
        pairs_over_processes = self.accelerator.reduce(torch.tensor(pairs, device=self.accelerator.device), "sum")
        self.pair_weights.append(pairs_over_processes.item())
        if isinstance(result, tuple):
            loss, outputs = result
            return loss * weight, outputs
        return result * weight

    def reweigh_metrics(self, metrics: dict[str, list[float]]) -> None:
        """TRL averages its per-micro-batch metrics equally; these micro-batches hold different numbers of pairs, so
        weigh the per-pair means by pairs, as one padded batch of the same pairs would; and add the steps' cost ratio.
        In place, before a log."""
        weights, self.pair_weights = self.pair_weights, []
        ratios, self.cost_ratios = self.cost_ratios, []
        if ratios:
            metrics[COST_RATIO_METRIC] = ratios
        if not weights:
            return
        for key in PER_PAIR_METRICS:
            if len(metrics.get(key, ())) == len(weights):
                values = metrics[key]
                metrics[key] = [sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)]
