"""`PairWeightedSteps`: micro-batches of different pair counts, trained as one batch of the step's pairs.

Token-budget batching and balanced batches both give processes and micro-steps rows of different numbers of pairs.
TRL's loss is the mean over a micro-batch's pairs, Trainer divides it by the accumulation steps and data parallelism
averages gradients over processes: every micro-batch would count the same, whatever its pairs. Here each micro-batch's
loss is weighted by its pairs, so a step's loss and gradient are the mean over all of the step's pairs, those of
padded TRL on one batch of them; TRL's per-pair metrics are weighed the same way. Such micro-batches come from a
batch sampler, which the trainer's dataloader takes (`batch_sampler_dataloader`) and tells each epoch
(`EpochOfBatchSampler`).
"""

from __future__ import annotations

import functools
import math

import torch
from transformers import TrainerCallback

from ..integrations.accelerate import uneven_gathers
from ..packing.balance import imbalance, row_cost
from ..packing.layout import HOST_ROW

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
COST_RATIO_METRIC = "padfree/balance_cost_max_over_mean"
# How a step's rows were split over ranks (dynamic context parallelism): the mean ranks of a row, and the tokens each
# rank held at a micro-step (its row's over the row's ranks, padding included), their max and mean over ranks and
# micro-steps
RANK_SHARE_METRICS = ("padfree/ranks_per_row", "padfree/rank_tokens_max", "padfree/rank_tokens_mean")


def batch_sampler_dataloader(batch_sampler, dataset, collate_fn, args, accelerator):
    """Trainer's own dataloader settings, with `batch_sampler`'s micro-batches in place of a fixed batch size; on
    every process the same micro-batches, which `accelerator.prepare` deals out round-robin."""
    from torch.utils.data import DataLoader
    from transformers.trainer_utils import seed_worker

    settings = {}
    if args.dataloader_num_workers > 0:  # DataLoader refuses these without workers
        settings["multiprocessing_context"] = args.dataloader_multiprocessing_context
        settings["prefetch_factor"] = args.dataloader_prefetch_factor
    dataloader = DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers,
        in_order=args.dataloader_in_order,
        worker_init_fn=functools.partial(
            seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
        ),
        **settings,
    )
    return accelerator.prepare(dataloader)


class EpochOfBatchSampler(TrainerCallback):
    """Tells the batch sampler the epoch before the epoch's batches are drawn. Trainer's own `set_epoch` does not
    reach it when resuming mid-epoch with several processes (`skip_first_batches` wraps accelerate's shard, which has
    no `set_epoch`), and the resumed epoch would replay epoch 0's order."""

    def __init__(self, batch_sampler):
        self.batch_sampler = batch_sampler

    def on_epoch_begin(self, args, state, control, **kwargs):
        # `state.epoch` is the epochs done, a whole number at an epoch's start, a fraction when resumed mid-epoch
        self.batch_sampler.set_epoch(math.floor(state.epoch + 1e-9))


class PairWeightedSteps:
    """The step's part of uneven micro-batches:

    count        each micro-batch's pairs over processes, and each process's row costs, in one gather before the
                 step's first forward (`count_step`); the costs' max/mean is logged as `COST_RATIO_METRIC`
    loss         each micro-batch's loss weighted by its pairs (`weighted_loss`)
    logs         TRL's per-pair means weighted by pairs (`reweigh_metrics`)

    A row split over several ranks is held by each of them: each counts its share of the row's pairs (pairs / ranks),
    so a step's pairs are counted once however its rows are split.

    Args:
        accelerator: the trainer's.
        shape (`DecoderShape` or `None`): the model's, to price rows (`packing.balance.row_cost`); None logs no cost.
        reference_forward (`bool`): whether a step runs the reference model (not precomputed).
        rank_shares (`bool`): log how rows were split over ranks (`RANK_SHARE_METRICS`; dynamic context parallelism).
    """

    def __init__(self, accelerator, shape=None, reference_forward: bool = True, rank_shares: bool = False):
        self.accelerator = accelerator
        self.shape = shape
        self.reference_forward = reference_forward
        self.rank_shares = rank_shares
        self.pairs_in_step: float | None = None  # over processes, counted before the step's first forward
        self.step_pair_counts: list[int] = []  # each of the step's micro-batches' pairs over processes, to come
        self.pair_weights: list[float] = []  # pairs of each training micro-batch, over processes, since the last log
        self.cost_ratios: list[float] = []  # each step's COST_RATIO_METRIC since the last log
        self.shares: dict[str, list[float]] = {name: [] for name in RANK_SHARE_METRICS}  # each step's, since the log

    def count_step(self, batch_samples: list[dict], ranks_of=lambda batch: 1) -> None:
        """The pairs of each of an optimizer step's micro-batches (Trainer fetches them all first) over processes,
        each row's cost for the step's cost ratio, and how rows were split over ranks: one gather of 4 numbers per
        micro-batch and process, the step's only collective of its own. `ranks_of(batch)`: over how many ranks a
        micro-batch's row is split."""
        rows = [batch[HOST_ROW] for batch in batch_samples]
        ranks = [ranks_of(batch) for batch in batch_samples]
        costs = [0.0] * len(rows)
        if self.shape is not None:
            costs = [row_cost(self.shape, row, self.reference_forward) for row in rows]
        values = [
            [len(row.seq_lens) // 2 / share for row, share in zip(rows, ranks, strict=True)],  # this rank's pairs
            costs,
            [row.cu_seq_lens[-1] / share for row, share in zip(rows, ranks, strict=True)],  # tokens this rank holds
            [1 / share for share in ranks],  # this rank's share of a row
        ]
        values = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        gathered = self.accelerator.gather(values[None]).tolist()  # [process][value][micro-step]
        micro_steps = range(len(rows))
        pairs_by_micro_step = [round(sum(process[0][step] for process in gathered)) for step in micro_steps]
        self.pairs_in_step = sum(pairs_by_micro_step)
        self.step_pair_counts = pairs_by_micro_step
        if self.shape is not None:
            self.cost_ratios.append(imbalance([[process[1][step] for process in gathered] for step in micro_steps]))
        if self.rank_shares:
            tokens = [process[2][step] for process in gathered for step in micro_steps]
            rows_in_step = sum(process[3][step] for process in gathered for step in micro_steps)
            self.shares["padfree/ranks_per_row"].append(len(tokens) / rows_in_step)
            self.shares["padfree/rank_tokens_max"].append(max(tokens))
            self.shares["padfree/rank_tokens_mean"].append(sum(tokens) / len(tokens))

    def weighted_loss(self, compute_loss, pairs: float, accumulation_steps: int, counted: bool = True):
        """`compute_loss()` (TRL's, the mean over this micro-batch's pairs), weighted so that after Trainer divides
        it by the accumulation steps and the gradient is averaged over processes, the step's loss is the mean over
        all of the step's pairs: `pairs` is this rank's share of them (its row's pairs over the ranks that split it).
        TRL's metric gathers accept this micro-batch's own pair count meanwhile, and leave this rank out where it is
        not `counted` (another rank counts its row)."""
        with uneven_gathers(self.accelerator, counted):
            result = compute_loss()
        weight = pairs * accumulation_steps * self.accelerator.num_processes / self.pairs_in_step
        self.pair_weights.append(self.step_pair_counts.pop(0))  # this micro-step's pairs over processes
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
        for name, values in self.shares.items():
            if values:
                metrics[name], self.shares[name] = values, []
        if not weights:
            return
        for key in PER_PAIR_METRICS:
            if len(metrics.get(key, ())) == len(weights):
                values = metrics[key]
                metrics[key] = [sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)]
