"""One DPO step on a CUDA GPU, padding-free against TRL's padded trainer on the same batch: a grouped-query text model
with a real head size (64; torch's varlen kernel in bf16, per-segment sdpa in fp32) and tiny vision-language models.

fp32 is held to the CPU tolerances (tests/support/tolerances.py). bf16 is judged against the noise of TRL itself: the
padded step on `sdpa` against the same padded step on `eager`; padding-free may differ from padded `sdpa` by at most
a few times that. Every figure is recorded (`--junitxml` keeps them as properties) and printed (`-s`):

    python -m pytest tests/integration/gpu/test_gpu_trainer.py -m gpu -s --junitxml=gpu.xml
"""

from __future__ import annotations

import pytest
import torch
from tolerances import BF16_GRAD_FLOOR, BF16_LOSS_FLOOR, BF16_NOISE_FACTOR
from trainer_utils import StepResult, assert_same_step, make_trainer, one_step

from trl_padfree import DPOTrainer
from trl_padfree.modeling import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Qwen2.5's attention shape at a tiny width: 4 query heads sharing 2 KV heads of size 64 (what torch 2.15 would send
# to cuDNN on SM90+ in bf16; `padfree_varlen` pins Flash)
GQA_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=2,
)


def difference(reference: StepResult, other: StepResult) -> dict[str, float]:
    """Absolute loss difference, and the largest gradient difference over the largest reference gradient."""
    scale = max(grad.float().abs().max().item() for grad in reference.grads.values())
    grad = max((other.grads[name].float() - grad.float()).abs().max().item() for name, grad in reference.grads.items())
    return {"loss": abs(other.loss - reference.loss), "grad": grad / scale}


def record(record_property, name: str, figures: dict[str, float]) -> None:
    for key, value in figures.items():
        record_property(f"{name}_{key}", value)
    print(f"\n{name}: " + ", ".join(f"{key} {value:.3g}" for key, value in figures.items()))


def assert_within_noise(packed: dict[str, float], noise: dict[str, float]) -> None:
    assert packed["loss"] <= BF16_NOISE_FACTOR * noise["loss"] + BF16_LOSS_FLOOR, (packed, noise)
    assert packed["grad"] <= BF16_NOISE_FACTOR * noise["grad"] + BF16_GRAD_FLOOR, (packed, noise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_query_model_step_equals_padded_trl(dtype, record_property, caplog):
    def trainer(padding_free: bool, attn_implementation: str):
        return make_trainer(
            padding_free,
            "qwen2",
            attn_implementation=attn_implementation,
            dtype=dtype,
            model_overrides=GQA_SHAPE,
            use_cpu=False,
            bf16=dtype == torch.bfloat16,
        )

    padded = one_step(trainer(False, "sdpa"))
    kernels.log_once.cache_clear()  # logged once per process: an earlier test may have said it already
    with caplog.at_level("INFO", logger="trl_padfree"):
        packed_trainer = trainer(True, "padfree_varlen")
        packed = one_step(packed_trainer)
    assert next(packed_trainer.model.parameters()).is_cuda
    name = f"gqa_{str(dtype).removeprefix('torch.')}"
    if dtype == torch.float32:
        record(record_property, name, difference(padded, packed))
        assert_same_step(padded, packed)
        return
    assert "Flash backend, chosen explicitly" in caplog.text  # the kernel choice is logged
    noise = difference(padded, one_step(trainer(False, "eager")))
    record(record_property, f"{name}_trl_noise", noise)
    record(record_property, name, difference(padded, packed))
    assert_within_noise(difference(padded, packed), noise)


@pytest.mark.parametrize("prefix_sharing", [False, True], ids=["row", "shared-prefix"])
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3", "idefics3"])
def test_vision_language_step_equals_padded_trl_in_bf16(model_type, prefix_sharing, record_property):
    from tiny_vision import make_vision_trainer, vision_preference_rows

    rows = vision_preference_rows(model_type, 8, images_per_row=(1, 2, 1, 1))

    def trainer(padding_free: bool, attn_implementation: str) -> DPOTrainer:
        return make_vision_trainer(
            model_type,
            padding_free,
            rows,
            dtype=torch.bfloat16,
            attn_implementation=attn_implementation,
            prefix_sharing=prefix_sharing and padding_free,
            bf16=True,
            use_cpu=False,
        )

    padded = one_step(trainer(False, "sdpa"))
    # `auto` picks padfree_varlen for the language model (Gemma 3's image spans attend both ways: sdpa is refused)
    packed_trainer = trainer(True, "sdpa")
    packed = one_step(packed_trainer)
    assert packed_trainer.model.config.get_text_config()._attn_implementation == "padfree_varlen"
    noise = difference(padded, one_step(trainer(False, "eager")))
    name = f"{model_type}{'_shared' if prefix_sharing else ''}_bf16"
    record(record_property, f"{name}_trl_noise", noise)
    record(record_property, name, difference(padded, packed))
    assert_within_noise(difference(padded, packed), noise)
