"""Report: the plan as the terminal shows it (model, setup, memory table, verdict, changes) and as JSON."""

from __future__ import annotations

from dataclasses import asdict

from . import context_parallel, fsdp2
from .memory import Estimate, encoded_image_tokens
from .search import Plan
from .setup import Setup
from .shapes import ModelShape
from .units import gib


def _count(number: int) -> str:
    return f"{number / 1e9:.2f}B" if number >= 10**9 else f"{number / 1e6:.2f}M"


def _setup_lines(setup: Setup) -> list[str]:
    offload = " and ".join(
        name for name, on in (("optimizer", setup.offload_optimizer), ("parameters", setup.offload_param)) if on
    )
    stage = f"ZeRO-{setup.zero_stage}" if setup.zero_stage else "no ZeRO (DDP)"
    if setup.fsdp2:
        stage = "FSDP2 (fully_shard per decoder layer)"
        offload = "parameters, gradients and optimizer" if setup.fsdp_offload_params else ""
    reference = {"gpu": "on the GPUs", "offload": "offloaded to CPU", "precompute": "precomputed"}[setup.reference]
    checkpointing = "on" if setup.activation_checkpointing else "off"
    tokens = f"{setup.tokens} tokens per micro-batch"
    if setup.context_parallel_size > 1:
        tokens = (
            f"{setup.tokens} tokens per micro-batch row, {context_parallel.local_tokens(setup)} on each of "
            f"{setup.context_parallel_size} GPUs (context parallelism)"
        )
    return [
        f"{_plural(setup.nodes, 'node')} x {_plural(setup.gpus_per_node, 'GPU')} of {gib(setup.gpu_memory)} GiB; {stage}, "
        f"{'offload ' + offload if offload else 'no offload'}; {setup.precision}; reference {reference}",
        f"{tokens}; activation checkpointing {checkpointing}; reserve {gib(setup.reserve)} GiB per GPU",
    ]


def accelerate_config(setup: Setup) -> dict | None:
    """The accelerate config to launch the plan with and what to change in it; None for DeepSpeed and DDP, whose
    reports name no config."""
    return fsdp2.accelerate_config(setup) if setup.fsdp2 else None


def _config_text(config: dict) -> str:
    changes = ", ".join(f"{key}: {str(value).lower()}" for key, value in config["changes"].items())
    return f"--accelerate_config {config['file']}" + (f", with {changes}" if changes else "")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''}"


def _model_line(shape: ModelShape) -> str:
    line = f"{shape.name}: {_count(shape.total_params)} parameters"
    if shape.largest_layer_params is not None:
        line += f", largest layer {_count(shape.largest_layer_params)}"
    if shape.num_layers is not None:
        line += (
            f"; {shape.num_layers} layers, hidden {shape.hidden_size}, MLP {shape.intermediate_size}, "
            f"vocab {shape.vocab_size}"
        )
    return line


def _against(available: int | None, fits: bool | None) -> str:
    if available is None:
        return "not checked (no --cpu-memory)"
    return f"of {gib(available)}: {'fits' if fits else 'does not fit'}"


def _share(parts: int) -> str:
    return "all of it" if parts == 1 else f"1/{parts} of it"


def _labels(setup: Setup) -> dict[str, str]:
    """What each row of the memory table holds, for DeepSpeed (or DDP)."""
    offloaded = setup.reference == "offload"
    return {
        "policy": f"DeepSpeed ZeRO-{setup.zero_stage}" if setup.zero_stage else "16 bytes/param",
        "reference": {
            "gpu": f"{setup.precision}, {_share(setup.total_gpus) if setup.zero_stage == 3 else 'whole copy'}",
            "offload": "offloaded",
            "precompute": "precomputed log-probs",
        }[setup.reference],
        "cpu policy": f"DeepSpeed{'' if setup.zero_stage else ': not modelled at stage 0'}",
        "cpu reference": f"{setup.precision}, {_share(setup.nodes)}, pinned" if offloaded else "none",
    }


def _fsdp2_labels(setup: Setup) -> dict[str, str]:
    """What each row of the memory table holds under FSDP2."""
    offloaded = fsdp2.reference_offloaded(setup)
    policy = (
        "FSDP2: gathered layers, shards on CPU"
        if setup.fsdp_offload_params
        else f"FSDP2: 16 bytes/param / {setup.total_gpus}, gathered layers"
    )
    reference = f"{setup.precision}, {_share(setup.total_gpus)}"
    if setup.reference == "precompute":
        reference = "precomputed log-probs"
    elif offloaded:
        reference = "offloaded" if setup.reference == "offload" else "offloaded with the policy"
    return {
        "policy": policy,
        "reference": reference,
        "cpu policy": "FSDP2 offload, pinned" if setup.fsdp_offload_params else "FSDP2: none without offload",
        "cpu reference": f"{setup.precision}, {_share(setup.nodes)}, pinned" if offloaded else "none",
    }


def memory_table(setup: Setup, result: Estimate) -> list[str]:
    """The per-GPU and per-node CPU parts of `result`, one per line, in GiB."""
    labels = _fsdp2_labels(setup) if setup.fsdp2 else _labels(setup)
    activations = "not estimated" if result.activations_gpu is None else "estimate"
    tokens = f"{setup.tokens} tokens"
    if setup.context_parallel_size > 1:
        tokens = f"{context_parallel.local_tokens(setup)} tokens, 1/{setup.context_parallel_size} of the row"
    rows = [
        ("Per GPU", "GiB", ""),
        (f"  policy: weights, gradients, Adam ({labels['policy']})", gib(result.policy_gpu), ""),
        (f"  reference model ({labels['reference']})", gib(result.reference_gpu), ""),
        (f"  activations of {tokens} ({activations})", gib(result.activations_gpu), ""),
    ]
    if setup.image_tokens:
        rows.append(
            (
                f"    of which the vision tower, {vision_share(setup)}",
                gib(result.vision_gpu),
                "",
            )
        )
    if setup.context_parallel_size > 1:
        buffers = "not estimated" if result.context_parallel_gpu is None else "estimate"
        rows.append(
            (f"  context-parallel K/V buffers of the whole row ({buffers})", gib(result.context_parallel_gpu), "")
        )
    rows += [
        ("  reserve (CUDA context, NCCL, buffers)", gib(result.reserve_gpu), ""),
        ("  total", gib(result.gpu_total), _against(result.gpu_memory, result.gpu_fits)),
        ("Per node, CPU", "", ""),
        (f"  policy ({labels['cpu policy']})", gib(result.policy_cpu), ""),
        (f"  reference model ({labels['cpu reference']})", gib(result.reference_cpu), ""),
        ("  total", gib(result.cpu_total), _against(result.cpu_memory, result.cpu_fits)),
    ]
    width = max(len(label) for label, _, _ in rows)
    return [f"{label:<{width}}  {value:>6}  {verdict}".rstrip() for label, value, verdict in rows]


def format_report(plan: Plan) -> str:
    """The plan as the terminal shows it: model, setup, the memory table, the verdict and, if it does not fit, the
    cheapest change that does and what each change alone would give."""
    current = plan.estimate
    hardware, training = _setup_lines(plan.setup)
    lines = [f"Model  {_model_line(plan.model)}", f"Setup  {hardware}", f"       {training}"]
    config = accelerate_config(plan.setup)
    if config is not None:
        lines.append(f"Config {_config_text(config)}")
    lines.append("")
    lines += [*memory_table(plan.setup, current), ""]
    spare = gib(current.gpu_memory - current.gpu_total)
    if current.fits and current.activations_gpu is None:
        lines.append(f"Fits before activations, which are not estimated: {spare} GiB per GPU left for them.")
    elif current.fits:
        lines.append(f"Fits, {spare} GiB per GPU to spare.")
    else:
        short = [name for name, fits in (("GPU", current.gpu_fits), ("CPU", current.cpu_fits)) if fits is False]
        lines.append(f"Does not fit in {' and '.join(short)} memory.")
        if plan.suggestion is None:
            lines.append("No combination of the changes below fits.")
        else:
            changes, fixed_setup, fixed = plan.suggestion
            lines.append(f"Cheapest change that fits: {' + '.join(change.description for change in changes)}")
            lines.append(
                f"  then per GPU {gib(fixed.gpu_total)} GiB of {gib(fixed.gpu_memory)}; per node CPU "
                f"{gib(fixed.cpu_total)} GiB, {_against(fixed.cpu_memory, fixed.cpu_fits)}"
            )
            fixed_config = accelerate_config(fixed_setup)
            if fixed_config is not None:
                lines.append(f"  config {_config_text(fixed_config)}")
        table = [("Each change alone", "GPU GiB", "CPU GiB/node", "fits")] + [
            (f"  {change.description}", gib(result.gpu_total), gib(result.cpu_total), "yes" if result.fits else "no")
            for change, result in plan.alternatives
        ]
        widths = [max(len(row[column]) for row in table) for column in range(4)]
        lines.append("")
        lines += [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in table]
    lines += ["", *(f"Note: {note}" for note in plan.notes)]
    return "\n".join(lines)


def plan_to_json(plan: Plan) -> dict:
    """The plan's numbers, in bytes; `fits` and the suggestion as the report prints them."""
    suggestion = None
    if plan.suggestion is not None:
        changes, setup, fixed = plan.suggestion
        suggestion = {
            "changes": [change.description for change in changes],
            "setup": asdict(setup),
            "accelerate_config": accelerate_config(setup),
            "estimate": {**asdict(fixed), "fits": fixed.fits},
        }
    return {
        "model": asdict(plan.model),
        "setup": asdict(plan.setup),
        "engine": plan.setup.engine,
        "accelerate_config": accelerate_config(plan.setup),
        "estimate": {**asdict(plan.estimate), "fits": plan.estimate.fits},
        "fits": plan.estimate.fits,
        "suggestion": suggestion,
        "alternatives": [
            {"change": change.description, "estimate": {**asdict(result), "fits": result.fits}}
            for change, result in plan.alternatives
        ],
        "notes": plan.notes,
    }


def vision_share(setup: Setup) -> str:
    if setup.deal_images and setup.context_parallel_size > 1:
        return f"its share of the row's images: {encoded_image_tokens(setup)} of {setup.image_tokens} image tokens"
    return f"all {setup.image_tokens} image tokens of the row"
