"""`torch_compile=True`: accelerate wraps each model it prepares in `torch.compile`'s `OptimizedModule` (the reference
at TRL's `__init__`, the policy in `train()`). The architecture check judges the class under the wrapper, the packed
forward goes on that class's own `forward` (which the compiled wrapper calls), and a compiled packed step equals TRL's
compiled padded step on the same batches: loss, gradients and metrics.

The default suite compiles with `aot_eager` (dynamo traces the packed forward, with its graph breaks, guards and
dynamic shapes, and AOTAutograd builds the backward: all but inductor's code generation, which costs minutes on
2 CPU cores); the `slow` test compiles with inductor, TrainingArguments' default backend."""

import pytest
import torch
from tiny_fixtures import make_model
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.utils import counters
from trainer_utils import StepResult, assert_same_step, make_trainer

from trl_padfree.integrations.torch import uncompiled
from trl_padfree.modeling.backends import ATTN_IMPLEMENTATION
from trl_padfree.modeling.check.packability import architecture_verdict, check_packable


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether `model` is the wrapper `torch.compile(module)` returns."""
    return isinstance(model, OptimizedModule)


def test_the_architecture_check_sees_through_torch_compile():
    model = make_model("llama")
    compiled = torch.compile(model)  # lazy: nothing is compiled before a call
    assert is_compiled(compiled) and uncompiled(compiled) is model

    verdict = architecture_verdict(compiled, ATTN_IMPLEMENTATION)

    assert verdict.exact, verdict.reason
    assert verdict.model_class == "LlamaForCausalLM"
    check_packable(compiled, attn_implementation=ATTN_IMPLEMENTATION)  # does not raise


def test_a_compiled_model_that_does_not_pack_is_refused_for_its_own_reason():
    # OPT's sdpa mask ignores packed positions: refused as OPT, not as a wrapper whose twin cannot be built
    compiled = torch.compile(make_model("opt", attn_implementation="sdpa"))

    with pytest.raises(ValueError, match="cannot train OPTForCausalLM") as refusal:
        check_packable(compiled)

    assert "packed sequences see each other" in str(refusal.value)
    assert "twin could not be built" not in str(refusal.value)


def test_the_trainer_packs_the_models_under_the_compiled_wrapper():
    trainer = make_trainer(True, torch_compile=True, torch_compile_backend="aot_eager")

    assert is_compiled(trainer.ref_model)  # accelerate compiled the reference inside TRL's __init__
    assert trainer.padding_free_enabled
    assert trainer._padding_free.plan.attention == (("LlamaForCausalLM", ATTN_IMPLEMENTATION),) * 2


@pytest.fixture
def fresh_dynamo():
    # Compiled code is cached per code object across trainers: each trainer compiles from scratch, and no earlier
    # test's entries count towards dynamo's recompile limit (past which it would silently run eager)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_steps(trainer, batches: int) -> tuple[list[StepResult], list[int]]:
    """`trainer_utils.one_step` on the policy compiled as `train()` compiles it (accelerate's `prepare_model`), on the
    first `batches` micro-batches of the training set in order; with the graphs dynamo has compiled after each."""
    policy = trainer.accelerator.prepare_model(trainer.model)
    assert is_compiled(policy) and is_compiled(trainer.ref_model)
    size, dataset = trainer.args.per_device_train_batch_size, trainer.train_dataset
    results, graphs = [], []
    for start in range(0, batches * size, size):
        batch = trainer._prepare_inputs(trainer.data_collator([dataset[i] for i in range(start, start + size)]))
        trainer.model.train()
        trainer._metrics["train"].clear()
        trainer.model.zero_grad()
        with trainer.compute_loss_context_manager(), trainer.accelerator.autocast():
            loss = trainer.compute_loss(policy, batch)
        loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
        metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
        results.append(StepResult(loss.item(), grads, metrics))
        graphs.append(counters["stats"]["unique_graphs"])
    return results, graphs


def assert_compiled_packed_equals_compiled_padded(backend: str, batches: int) -> None:
    steps, graphs = {}, {}
    for padding_free in (False, True):
        torch._dynamo.reset()
        counters.clear()
        trainer = make_trainer(
            padding_free, torch_compile=True, torch_compile_backend=backend, num_pairs=4 * batches, batch_size=4
        )
        steps[padding_free], graphs[padding_free] = compiled_steps(trainer, batches)
    for padded, packed in zip(steps[False], steps[True], strict=True):
        assert_same_step(padded, packed)
    assert graphs[True][0] > 0  # dynamo compiled the packed forward, not only ran it
    # The second row compiles once more (dynamo then marks the lengths dynamic), as a padded batch of a new width
    # does; after that, rows of other lengths and boundaries reuse the graphs: no recompilation per batch
    assert len(set(graphs[True][1:])) <= 1, graphs[True]


def test_a_compiled_packed_step_equals_a_compiled_padded_step(fresh_dynamo):
    # One batch (31 s on 2 cores); the next batches, which recompile once and then reuse the graphs, take 50 s more
    assert_compiled_packed_equals_compiled_padded("aot_eager", batches=1)


@pytest.mark.slow
def test_compiled_packed_steps_equal_compiled_padded_steps_with_inductor_without_recompiling(fresh_dynamo):
    assert_compiled_packed_equals_compiled_padded("inductor", batches=3)
