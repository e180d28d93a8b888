"""The cheapest change that fits: candidate changes to a setup, the search over their combinations, and the plan."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from . import context_parallel, fsdp2
from .memory import Estimate, estimate
from .setup import Setup
from .shapes import ModelShape
from .units import gib

# The changes that can make a run fit, cheapest in throughput first (docs/concepts/memory-planning.md says why in this order)
CHANGE_ORDER = (
    "precompute reference",  # one reference pass over the data before training, none per step
    "offload reference",  # the reference's weights cross PCIe on every reference forward
    "activation checkpointing",  # one more forward per step: about a third more compute
    "fewer tokens",  # smaller micro-batches: less efficient matmuls, ZeRO-3 gathers the weights per micro-batch
    "higher ZeRO stage",  # more communication per step
    "offload optimizer",  # Adam on the CPU, gradients and weights over PCIe at every optimizer step
    "offload parameters",  # every weight over PCIe in every forward and backward
    "more nodes",  # more hardware
)


@dataclass(frozen=True)
class Change:
    """One change to a setup: `kind` is one of `CHANGE_ORDER`, `step` how far it goes (0 the mildest)."""

    kind: str
    step: int
    description: str
    fields: dict = field(hash=False)  # the `Setup` fields it sets

    @property
    def rank(self) -> int:
        return CHANGE_ORDER.index(self.kind)

    @property
    def family(self) -> str:
        # A setup takes one change per family: the reference is precomputed or offloaded, not both
        return "reference" if self.kind.endswith("reference") else self.kind


def candidate_changes(shape: ModelShape, setup: Setup, min_tokens: int) -> list[Change]:
    """The changes worth trying on `setup`, in `CHANGE_ORDER` and mildest first. Invalid combinations fail later."""
    changes = []
    if setup.reference != "precompute":
        description = "precompute the reference log-probs (precompute_ref_log_probs: true)"
        changes.append(Change("precompute reference", 0, description, {"reference": "precompute"}))
    if setup.reference == "gpu":
        description = "offload the reference to CPU (ref_offload: true)"
        changes.append(Change("offload reference", 0, description, {"reference": "offload"}))
    if not setup.activation_checkpointing:
        description = "activation checkpointing on (activation_checkpointing: true)"
        changes.append(Change("activation checkpointing", 0, description, {"activation_checkpointing": True}))
    if shape.no_activations_reason is None:  # fewer tokens only shrink the activations
        for step, count in enumerate(fewer_tokens(setup.tokens, min_tokens)):
            description = f"{count} tokens per micro-batch (fewer pairs or a lower max_length)"
            changes.append(Change("fewer tokens", step, description, {"tokens": count}))
    changes += fsdp2_changes(setup) if setup.fsdp2 else deepspeed_changes(setup)
    for step, nodes in enumerate(range(setup.nodes + 1, 8 * setup.nodes + 1)):
        description = f"{nodes} nodes ({nodes * setup.gpus_per_node} GPUs)"
        changes.append(Change("more nodes", step, description, {"nodes": nodes}))
    return changes


def deepspeed_changes(setup: Setup) -> list[Change]:
    """A higher ZeRO stage, then DeepSpeed's offloads: a DeepSpeed plan is never moved to FSDP2."""
    changes = []
    for step, stage in enumerate(range(setup.zero_stage + 1, 4)):
        changes.append(
            Change("higher ZeRO stage", step, f"ZeRO stage {stage} (zero_stage: {stage})", {"zero_stage": stage})
        )
    if not setup.offload_optimizer:
        description = "offload the optimizer to CPU (offload_optimizer_device: cpu)"
        changes.append(Change("offload optimizer", 0, description, {"offload_optimizer": True}))
    if not setup.offload_param:
        description = "offload the parameters to CPU (offload_param_device: cpu, with the optimizer)"
        changes.append(
            Change("offload parameters", 0, description, {"offload_param": True, "offload_optimizer": True})
        )
    return changes


def fsdp2_changes(setup: Setup) -> list[Change]:
    """FSDP2 already shards everything over all GPUs, and offloads parameters, gradients and optimizer together."""
    if setup.fsdp_offload_params:
        return []
    description = "offload the parameters, gradients and optimizer to CPU (fsdp_offload_params: true)"
    return [Change("offload parameters", 0, description, {"fsdp_offload_params": True})]


def fewer_tokens(tokens: int, min_tokens: int) -> list[int]:
    """Halvings of `tokens` down to `min_tokens`, which ends the list.

    >>> fewer_tokens(8192, 2048), fewer_tokens(6000, 2048), fewer_tokens(2048, 2048)
    ([4096, 2048], [3000, 2048], [])
    """
    counts = []
    while tokens // 2 > min_tokens:
        tokens //= 2
        counts.append(tokens)
    return counts + [min_tokens] if tokens > min_tokens else counts


def _cost(changes: list[Change]) -> tuple:
    # The dearest change decides, then how far it goes, so a cheap change is added before a dear one goes further;
    # then fewer changes
    dearest = max(changes, key=lambda change: (change.rank, change.step))
    return dearest.rank, dearest.step, len(changes), sum(c.rank for c in changes), sum(c.step for c in changes)


def try_changes(shape: ModelShape, setup: Setup, changes: list[Change]) -> tuple[Setup, Estimate] | None:
    """`setup` with `changes` applied and its estimate, or None where DeepSpeed or TRL would refuse the result."""
    changed = setup
    for change in changes:
        changed = replace(changed, **change.fields)
    try:
        return changed, estimate(shape, changed)
    except (ValueError, NotImplementedError):
        return None


def cheapest_fix(shape: ModelShape, setup: Setup, min_tokens: int) -> tuple[list[Change], Setup, Estimate] | None:
    """The cheapest combination of changes, one per family, that fits (a few thousand tries at most), or None."""
    families: dict[str, list[Change]] = {}
    for change in candidate_changes(shape, setup, min_tokens):
        families.setdefault(change.family, []).append(change)
    best = None
    for choice in itertools.product(*([None, *family] for family in families.values())):
        changes = [change for change in choice if change is not None]
        if not changes or (best is not None and _cost(changes) >= _cost(best[0])):
            continue
        tried = try_changes(shape, setup, changes)
        if tried is not None and tried[1].fits:
            best = (changes, *tried)
    return best


def single_changes(shape: ModelShape, setup: Setup, min_tokens: int) -> list[tuple[Change, Estimate]]:
    """Each kind of change alone: its mildest step that fits, or else its furthest one, with the estimate."""
    by_kind: dict[str, list[tuple[Change, Estimate]]] = {}
    for change in candidate_changes(shape, setup, min_tokens):
        tried = try_changes(shape, setup, [change])
        if tried is not None:
            by_kind.setdefault(change.kind, []).append((change, tried[1]))
    return [next((row for row in rows if row[1].fits), rows[-1]) for rows in by_kind.values()]


@dataclass
class Plan:
    """Everything the report and the JSON show."""

    model: ModelShape
    setup: Setup
    estimate: Estimate
    suggestion: tuple[list[Change], Setup, Estimate] | None  # the cheapest fix; None if it fits, or if nothing does
    alternatives: list[tuple[Change, Estimate]]  # each kind of change alone, when it does not fit
    notes: list[str]


def make_plan(shape: ModelShape, setup: Setup, min_tokens: int = 2048) -> Plan:
    """Estimate `setup`; if it does not fit, search for the cheapest change that does."""
    current = estimate(shape, setup)
    fits = current.fits
    return Plan(
        model=shape,
        setup=setup,
        estimate=current,
        suggestion=None if fits else cheapest_fix(shape, setup, min_tokens),
        alternatives=[] if fits else single_changes(shape, setup, min_tokens),
        notes=plan_notes(shape, setup),
    )


def plan_notes(shape: ModelShape, setup: Setup) -> list[str]:
    notes = fsdp2_notes(shape, setup) if setup.fsdp2 else []
    if setup.zero_stage == 0:
        notes.append("Stage 0 policy states: 16 bytes/param computed here (DeepSpeed has no estimator without ZeRO).")
    if setup.zero_stage == 1:
        notes.append("ZeRO-1: DeepSpeed's ZeRO-2 estimate plus the 16-bit gradients stage 1 does not partition.")
    if shape.no_activations_reason is not None:
        notes.append(f"Activations not estimated ({shape.no_activations_reason}); the GPU total leaves them out.")
    else:
        notes.append(
            "Activations are an estimate (formula in docs/concepts/memory-planning.md), assuming varlen flash attention."
        )
        if setup.context_parallel_size > 1:
            notes.append(context_parallel_note(shape, setup))
    if shape.largest_layer_params is None and not setup.fsdp2:
        notes.append("ZeRO-3 not planned: it needs the largest layer's size (--largest-layer, or a config).")
    if setup.cpu_memory is None:
        notes.append("CPU memory not checked: pass --cpu-memory (per node).")
    return notes


def context_parallel_note(shape: ModelShape, setup: Setup) -> str:
    """What the context-parallel K/V buffers are made of."""
    kept = "" if setup.activation_checkpointing else ", and the copies each other layer keeps for its backward"
    return (
        f"Context parallelism: each GPU runs {context_parallel.local_tokens(setup)} of the row's tokens; attention "
        f"gathers the whole row's keys and values, {gib(context_parallel.row_buffer_bytes(shape, setup))} GiB, and "
        f"{context_parallel.row_buffers(shape, setup)} such buffers are counted (a layer's backward builds the row's "
        f"gradient from two zero-filled row-sized halves{kept})."
    )


def fsdp2_notes(shape: ModelShape, setup: Setup) -> list[str]:
    """The parts of the FSDP2 policy figure, and the reference sharding it assumes."""
    sharded = gib(fsdp2.sharded_state_bytes(shape, setup))
    where = ", in its node's CPU memory (fsdp_offload_params)" if setup.fsdp_offload_params else ""
    notes = [
        f"FSDP2 policy per GPU: {sharded} GiB of fp32 weight, gradient and Adam shards (16 bytes/param / "
        f"{setup.total_gpus}){where}; {gib(fsdp2.gathered_bytes(shape, setup))} GiB of gathered {setup.precision} "
        f"units (2 layers and the tail); {gib(fsdp2.gradient_buffer_bytes(shape, setup))} GiB of gradient "
        "reduce-scatter buffers."
    ]
    if setup.reference == "precompute":
        return notes
    notes.append(
        "FSDP2 reference: sharded per decoder layer as trl-padfree prepares it (TRL alone shards it as one unit, "
        "gathering all of it in each reference forward)."
    )
    excess = fsdp2.reference_gathered_excess(shape, setup)
    if excess:
        notes.append(
            f"FSDP2 reference: its row counts {gib(excess)} GiB per GPU for the embeddings and LM head its forward "
            "gathers, beyond what the policy's gathered layers and gradient buffers take later, in its backward."
        )
    return notes
