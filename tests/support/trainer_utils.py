"""Build padded (TRL) and padding-free trainers on the same tiny model and data, and compare one step of each."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tiny_fixtures import make_model, make_preference_dataset, make_tokenizer
from tolerances import FP32, HALF, LOSS_ATOL, LOSS_RTOL, Tolerances
from transformers import PreTrainedModel, TrainerCallback

from trl_padfree import DPOConfig, DPOTrainer


@dataclass(frozen=True)
class Precision:
    """How users run a step: trainer options, the weights' dtype, and on this CPU an autocast the step runs under
    where accelerate adds none (it autocasts fp16 on CUDA only)."""

    trainer_options: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None
    tolerances: Tolerances = FP32


# The precisions users train in, each held to tolerances.HALF
PRECISIONS = {
    "trl_default": Precision(dict(bf16=True), tolerances=HALF),  # float32 weights under bf16 autocast
    "fp16_autocast": Precision(autocast=torch.float16, tolerances=HALF),  # float32 weights under fp16 autocast
    "bf16_weights": Precision(dtype=torch.bfloat16, tolerances=HALF),  # a model loaded in bf16, no autocast
}


# Every loss type of TRL 1.16's DPOTrainer
LOSS_TYPES = [
    "sigmoid",
    "hinge",
    "ipo",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]
# A few optimizer steps that learn visibly. SGD: Adam's first update divides by |g|, turning rounding noise on
# near-zero gradients into full-size steps
SGD_STEPS_WITH_ACCUMULATION = dict(
    num_pairs=16,
    batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=4,
    learning_rate=0.5,
    optim="sgd",
    logging_steps=1,
)


def make_trainer(
    padding_free: bool,
    model_type: str = "llama",
    attn_implementation: str = "sdpa",
    num_pairs: int = 8,
    batch_size: int = 8,
    ref_seed: int | None = 1,
    peft_config=None,
    trainer_class=DPOTrainer,
    config_class=DPOConfig,
    dtype: torch.dtype = torch.float32,
    model_overrides: dict | None = None,
    data_collator=None,
    model_factory: Callable[..., PreTrainedModel] | None = None,
    streamed: tuple[str, ...] = (),
    **config_kwargs,
):
    """A trainer on a tiny model; the reference has other weights (`ref_seed`) so the loss is not trivially ln 2.

    `model_factory(seed)` builds the policy (seed 0) and the reference in place of `make_model(model_type, ...)`.
    `streamed` names the datasets ("train", "eval") passed as `IterableDataset`s (set `max_steps` to train on one)."""
    config_kwargs.setdefault("report_to", [])
    config_kwargs.setdefault("save_strategy", "no")
    config_kwargs.setdefault("bf16", False)  # TRL's default is bf16 autocast; these comparisons are fp32 unless asked
    config_kwargs.setdefault("use_cpu", True)  # the GPU tests pass False
    args = config_class(
        output_dir=config_kwargs.pop("output_dir", "/tmp/trl-padfree-tests"),
        padding_free=padding_free,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        seed=0,
        **config_kwargs,
    )
    if model_factory is None:
        model_factory = functools.partial(
            make_model, model_type, attn_implementation=attn_implementation, dtype=dtype, **(model_overrides or {})
        )
    elif dtype != torch.float32:
        built = model_factory
        model_factory = lambda seed: built(seed=seed).to(dtype)  # noqa: E731
    model = model_factory(seed=0)
    # TRL would reload the reference from the model's hub name; tiny models have none, so pass it (PEFT needs none)
    ref_model = None
    if peft_config is None:
        ref_model = model_factory(seed=ref_seed)
    return trainer_class(
        model=model,
        ref_model=ref_model,
        args=args,
        data_collator=data_collator,
        train_dataset=_maybe_streamed(make_preference_dataset(num_pairs), "train" in streamed),
        eval_dataset=_maybe_streamed(make_preference_dataset(num_pairs, seed=1), "eval" in streamed),
        processing_class=make_tokenizer(),
        peft_config=peft_config,
    )


def _maybe_streamed(dataset, streamed: bool):
    return dataset.to_iterable_dataset() if streamed else dataset


def with_checkpointing(trainer, use_reentrant: bool = False):
    """Turn on gradient checkpointing as `train()` would (`one_step` does not call `train()`, which enables it)."""
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert trainer.model.is_gradient_checkpointing
    return trainer


@dataclass
class StepResult:
    loss: float
    grads: dict[str, torch.Tensor]
    metrics: dict[str, float]


def first_batch(trainer, num_examples: int | None = None) -> dict:
    """The first examples of the training set, collated by the trainer's own collator (no shuffling)."""
    dataset = trainer.train_dataset
    count = min(num_examples or trainer.args.per_device_train_batch_size, len(dataset))
    examples = [dataset[index] for index in range(count)]
    return trainer._prepare_inputs(trainer.data_collator(examples))


def one_step(trainer, num_examples: int | None = None, autocast: torch.dtype | None = None) -> StepResult:
    """Loss, parameter gradients and logged metrics of one forward/backward on the first batch; `autocast`: a CPU
    autocast dtype to run the forward under besides accelerate's (fp16, which accelerate autocasts on CUDA only)."""
    trainer.model.train()
    trainer._metrics["train"].clear()
    trainer.model.zero_grad()
    # `train()` wraps the policy in accelerate's autocast; the reference is wrapped at init. Match that here.
    # (an autocast entered with enabled=False would switch accelerate's off)
    cpu_autocast = contextlib.nullcontext() if autocast is None else torch.autocast("cpu", dtype=autocast)
    with trainer.compute_loss_context_manager(), trainer.accelerator.autocast(), cpu_autocast:
        loss = trainer.compute_loss(trainer.model, first_batch(trainer, num_examples))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return StepResult(loss.item(), grads, metrics)


def assert_same_step(
    padded: StepResult, packed: StepResult, grad_atol: float | None = None, tolerances: Tolerances = FP32
) -> None:
    """Same loss, gradients and TRL metrics within `tolerances`; `grad_atol` (default: the tolerances') times
    max(1, largest padded gradient) bounds the gradients."""
    loss_bound = tolerances.loss_atol + tolerances.loss_rtol * abs(padded.loss)
    assert abs(padded.loss - packed.loss) <= loss_bound, (padded.loss, packed.loss)
    assert padded.grads.keys() == packed.grads.keys()
    grad_atol = tolerances.grad_atol if grad_atol is None else grad_atol
    grad_atol = grad_atol * max(1.0, max(grad.abs().max().item() for grad in padded.grads.values()))
    for name, grad in padded.grads.items():
        torch.testing.assert_close(
            packed.grads[name].float(), grad.float(), atol=grad_atol, rtol=0, msg=f"gradient of {name}"
        )
    trl_metrics = {key for key in packed.metrics if not key.startswith("padfree/")}  # ours come on top of TRL's
    assert padded.metrics.keys() == trl_metrics
    for key, value in padded.metrics.items():
        if key in tolerances.exempt_metrics:
            continue
        tolerance = tolerances.metric_atol + tolerances.metric_rtol * abs(value)
        assert abs(packed.metrics[key] - value) <= tolerance, f"{key}: padded {value}, packed {packed.metrics[key]}"


def train_losses(trainer) -> list[float]:
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_precomputed_reference_matches_padded(**packed_options) -> None:
    """Reference log-probs precomputed by the packed trainer equal the padded ones, and so does the first step."""
    padded = make_trainer(False, precompute_ref_log_probs=True)
    packed = make_trainer(True, precompute_ref_log_probs=True, **packed_options)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        # Sums of ~60 log-probs near -55: one float32 step there is 3.8e-6 (measured, with prefix sharing), so the
        # bound is relative, as for losses
        torch.testing.assert_close(
            torch.tensor(packed.train_dataset[column]),
            torch.tensor(padded.train_dataset[column]),
            atol=LOSS_ATOL,
            rtol=LOSS_RTOL,
        )
    assert_same_step(one_step(padded), one_step(packed))


def trainer_on(train_dataset, padding_free: bool = True, eval_dataset=None, **options) -> DPOTrainer:
    args = DPOConfig(
        output_dir="/tmp/trl-padfree-tests", padding_free=padding_free, per_device_train_batch_size=4, seed=0,
        report_to=[], save_strategy="no", bf16=False, use_cpu=True, **options,
    )  # fmt: skip
    return DPOTrainer(
        model=make_model(seed=0), ref_model=make_model(seed=1), args=args, train_dataset=train_dataset,
        eval_dataset=eval_dataset, processing_class=make_tokenizer(),
    )  # fmt: skip


class FirstStepGradients(TrainerCallback):
    """The policy's gradients at the first optimizer step, before it: `grads`, by parameter name."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
