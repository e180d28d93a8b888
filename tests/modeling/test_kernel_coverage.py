"""Real head dims through strict stand-ins of torch's varlen kernel (tests/support/stand_in_kernels.py), which refuse what
ATen's Flash kernel refuses (head dims above 256 or not a multiple of 8, a value head dim other than the query's,
float32, mixed dtypes):

    one step      DeepSeek-V3 (multi-head latent attention: 192 query and key, 128 value) at its real head dims trains
                  one step equal to padded TRL in TRL's default precision, its value padded to 192 and the output
                  cropped (Gemma 4, GPT-OSS and Gemma 2 on their fused kernels: test_fused_kernels.py)
    coverage      `kernel_coverage` plans each layer of an architecture at its real head dims; the same twin's packed
                  forward through the strict stand-in makes exactly the kernel calls it plans, and no kernel refuses
                  one (a sample of types here; every type the models table calls exact with `-m slow`)
    precision     TRL's default (float32 weights under bf16 autocast), float32 under fp16 autocast, bf16 weights, and
                  a LoRA model whose norms are float32: one kernel call per attention call, one step equal to padded
                  TRL in the same precision; float32 without autocast runs per segment and says how to reach the kernel
"""

import logging

import pytest
import torch
from stand_in_fused_kernels import fused_stand_ins
from stand_in_fused_kernels import scaled_dot_product_attention as recorded_sdpa
from stand_in_kernels import CALLS, calls_of, varlen_stand_in
from tiny_architectures import make_tiny_model, real_head_dims
from tiny_fixtures import make_tokenizer
from trainer_utils import PRECISIONS, assert_same_step, make_trainer, one_step
from transformers import AutoConfig

from trl_padfree.cli.models import decoder_model_types, model_class_for
from trl_padfree.modeling.attention import varlen
from trl_padfree.modeling.attention.plan import SOFTCAP_WAY_OUT
from trl_padfree.modeling.backends import ATTN_IMPLEMENTATION
from trl_padfree.modeling.check.kernel_coverage import COVERAGE_AUTOCAST, kernel_coverage, planned_forward
from trl_padfree.modeling.check.packability import CHECK_PAIRS, check_architecture, check_row
from trl_padfree.modeling.check.stand_ins import stand_in_kernels
from trl_padfree.modeling.check.twin import build_twin
from trl_padfree.modeling.kernels.attention import FusedKernels

VOCAB_SIZE = len(make_tokenizer())
TRL_DEFAULT = PRECISIONS["trl_default"]


@pytest.fixture(autouse=True)
def fresh_records():
    CALLS.clear()
    varlen._log_fallback_once.cache_clear()
    yield
    CALLS.clear()


def steps(model_type: str, padded_attention: str | None = None, precision=TRL_DEFAULT):
    """TRL's padded step (on `padded_attention`, default the model's) and the packed step through the strict
    stand-in, on the model at its real head dims."""
    factory = real_head_dims(model_type)
    options = dict(model_factory=factory, dtype=precision.dtype, **precision.trainer_options)
    padded_options = {**options, "model_factory": real_head_dims(model_type, padded_attention)}
    padded = one_step(make_trainer(False, **padded_options), autocast=precision.autocast)
    make_trainer(True, **options)  # imports the model's modules
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        trainer = make_trainer(True, **options)
        CALLS.clear()
        packed = one_step(trainer, autocast=precision.autocast)
    return trainer, padded, packed


# ---- real head dims, one step ----


def test_deepseek_v3_mla_at_its_real_head_dims_trains_one_step_equal_to_padded_trl():
    trainer, padded, packed = steps("deepseek_v3")

    assert_same_step(padded, packed, tolerances=TRL_DEFAULT.tolerances)
    config = trainer.model.config
    assert (config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim) == (192, 128)
    calls = calls_of("varlen_attn")
    # Every layer, both forwards, on the kernel: the value padded to the query's 192 (the kernel takes one head dim)
    assert len(calls) == 2 * config.num_hidden_layers
    assert {call.details["head_dim"] for call in calls} == {192}


# ---- the plan at real head dims is what the kernel takes ----


def strict_forward_calls(model_type: str) -> int:
    """Fused kernel calls of one packed forward of `model_type`'s real-head-dim twin in TRL's default precision,
    through the strict stand-ins (the kernel branch taken, as on a GPU without flash-attn, like this machine); raises
    what a kernel would refuse, and if a segment would run sdpa's math backend."""
    model_class, config = model_class_for(AutoConfig.for_model(model_type))
    twin = build_twin(model_class, config, ATTN_IMPLEMENTATION, real_head_dims=True, dtype=torch.float32)
    _, packed = check_row(twin, CHECK_PAIRS, prefix_sharing=False, seed=1)
    CALLS.clear()
    stand_ins = dict(varlen=varlen_stand_in("2.15"), fused=fused_stand_ins(flash_attn=False), sdpa=recorded_sdpa)
    with stand_in_kernels(**stand_ins), torch.no_grad():
        with torch.autocast("cpu", dtype=COVERAGE_AUTOCAST):
            twin(packed_batch=packed, use_cache=False)
    math = [call for call in calls_of("sdpa") if call.details["backend"] == "math"]
    assert not math, f"{len(math)} segments on sdpa's math backend"
    return sum(len(calls_of(kernel)) for kernel in FUSED_KERNELS)


def coverage_of(model_type: str):
    model_class, config = model_class_for(AutoConfig.for_model(model_type))
    return kernel_coverage(model_class, config)


# Dense, sinks, 256- and 512-wide layers, latent attention; with -m slow also grouped, sliding, softcapped layers
# Gemma 4's and DeepSeek-V3's plans are checked call by call by their one-step tests above; their default configs'
# whole stacks here with -m slow
SAMPLE_TYPES = ("llama", "gpt_oss") + tuple(
    pytest.param(model_type, marks=pytest.mark.slow)
    for model_type in ("gemma4_text", "deepseek_v3", "qwen3", "mistral", "gemma2", "minicpm3", "phi")
)
EXPECTED_CELLS = {"gemma2": "26/26", "gemma4_text": "30/30", "gpt_oss": "36/36", "deepseek_v3": "61/61"}
FUSED_KERNELS = ("varlen_attn", "efficient_attention", "flash_attn_varlen_func", "flex_attention")


@pytest.mark.parametrize("model_type", SAMPLE_TYPES)
def test_the_kernel_takes_every_layer_the_coverage_plans_onto_it(model_type):
    coverage = coverage_of(model_type)

    assert coverage.error is None, coverage.error
    assert strict_forward_calls(model_type) == coverage.on_kernel
    if model_type in EXPECTED_CELLS:
        assert coverage.cell == EXPECTED_CELLS[model_type], coverage.describe()


def test_the_coverage_names_each_layers_kernel():
    # On a machine without flash-attn (this one): softcapping on FlexAttention
    assert coverage_of("gemma4_text").kernels == (("varlen", 25), ("efficient", 5))
    assert coverage_of("gpt_oss").kernels == (("varlen_sinks", 36),)
    assert coverage_of("gemma2").kernels == (("flex", 26),)
    assert coverage_of("deepseek_v3").padded == (("the value padded from 128 to the query's 192", 61),)
    assert not any(coverage_of(model_type).per_segment for model_type in ("gemma4_text", "gpt_oss", "gemma2"))


def test_the_coverage_says_why_layers_run_per_segment_where_a_kernel_is_missing():
    model_class, config = model_class_for(AutoConfig.for_model("gemma2"))
    coverage = kernel_coverage(model_class, config, varlen_stand_in("2.11"), FusedKernels())

    assert coverage.per_segment == (
        ("attention logit softcapping (no fused kernel here takes it: " + SOFTCAP_WAY_OUT + ")", 26),
    )


@pytest.mark.slow
def test_every_exact_type_runs_through_the_strict_kernel_at_its_real_head_dims():
    """The sweep behind docs/reference/models.md's kernel column: every type exact on `padfree_varlen`, its default
    config's head dims, through the strict stand-in: no kernel refusal anywhere, and the calls the coverage plans."""
    swept, failures = 0, {}
    for model_type in decoder_model_types():
        try:
            model_class, config = model_class_for(AutoConfig.for_model(model_type))
        except Exception:  # the table refuses a type whose default config cannot be built
            continue
        if not check_architecture(model_class, config, ATTN_IMPLEMENTATION).exact:
            continue
        swept += 1
        coverage = kernel_coverage(model_class, config)
        try:
            calls = strict_forward_calls(model_type)
        except Exception as error:  # noqa: BLE001 - every failure is reported, not the first
            failures[model_type] = f"{type(error).__name__}: {error}"
            continue
        if coverage.error is not None or calls != coverage.on_kernel or coverage.per_segment:
            failures[model_type] = f"planned {coverage.describe()}, the kernel was called {calls} times"
    assert swept > 100
    assert not failures, failures


# ---- users' precision reaches the kernel ----


@pytest.mark.parametrize("precision", ["trl_default", "fp16_autocast", "bf16_weights"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_users_precision_makes_one_kernel_call_per_attention_call_and_trains_equal(precision, model_type):
    setting = PRECISIONS[precision]
    factory = lambda seed: make_tiny_model(model_type, VOCAB_SIZE, seed=seed)  # noqa: E731
    options = dict(model_factory=factory, dtype=setting.dtype, **setting.trainer_options)
    padded = one_step(make_trainer(False, **options), autocast=setting.autocast)
    make_trainer(True, **options)
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        trainer = make_trainer(True, **options)
        CALLS.clear()
        packed = one_step(trainer, autocast=setting.autocast)

    assert_same_step(padded, packed, tolerances=setting.tolerances)
    calls = calls_of("varlen_attn")
    assert len(calls) == 2 * trainer.model.config.num_hidden_layers  # policy and reference, every layer
    half = torch.float16 if precision == "fp16_autocast" else torch.bfloat16
    assert {call.details["input_dtype"] for call in calls} == {half}


def test_a_lora_model_with_float32_norms_reaches_the_kernel():
    """bf16 weights, float32 norms (as PEFT's k-bit preparation leaves them) and float32 LoRA adapters (PEFT's
    default), under TRL's autocast: attention gets float32 queries and keys, and computes in bf16 on the kernel.
    (Without autocast TRL's padded step fails on such a model: a bf16 projection of float32 hidden states.)"""
    from peft import LoraConfig

    def with_float32_norms(model):
        for module in model.modules():
            if "norm" in type(module).__name__.lower():
                module.float()
        return model

    def factory(seed):
        return with_float32_norms(make_tiny_model("llama", VOCAB_SIZE, seed=seed, dtype=torch.bfloat16))

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    options = dict(model_factory=factory, peft_config=lora, **TRL_DEFAULT.trainer_options)
    padded = one_step(make_trainer(False, **options))
    make_trainer(True, **options)
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        trainer = make_trainer(True, **options)
        CALLS.clear()
        packed = one_step(trainer)

    assert_same_step(padded, packed, tolerances=TRL_DEFAULT.tolerances)
    calls = calls_of("varlen_attn")
    assert len(calls) == 2 * trainer.model.config.num_hidden_layers
    assert {call.details["input_dtype"] for call in calls} == {torch.bfloat16}


def test_float32_without_autocast_runs_per_segment_and_says_how_to_reach_the_kernel(caplog):
    make_trainer(True)
    with (
        stand_in_kernels(varlen=varlen_stand_in("2.15")),
        caplog.at_level(logging.INFO, logger="trl_padfree.modeling.attention.varlen"),
    ):
        trainer = make_trainer(True)
        CALLS.clear()
        one_step(trainer)

    assert not calls_of("varlen_attn")
    messages = [record.getMessage() for record in caplog.records if "per-segment" in record.getMessage()]
    assert len(messages) == 1
    assert "torch.float32 inputs" in messages[0] and "set bf16=True (TRL's default)" in messages[0]


def test_the_planned_forward_runs_on_the_cpu_path():
    # The coverage's forward is planning only: it never calls a kernel, so it runs on any machine
    model_class, config = model_class_for(AutoConfig.for_model("llama"))
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        from trl_padfree.modeling.check.stand_ins import cpu_twin_kernels
        from trl_padfree.modeling.kernels.attention import torch_varlen_kernel

        with cpu_twin_kernels():
            plans = planned_forward(model_class, config, torch_varlen_kernel())
    assert len(plans) == config.num_hidden_layers and all(plan.on_kernel for plan in plans)
    assert not calls_of("varlen_attn")


def test_varlen_calls_are_counted_for_reports():
    from trl_padfree.integrations.transformers import attention_calls_counted
    from trl_padfree.modeling.kernels.attention import varlen_calls_counted

    make_trainer(True)
    with stand_in_kernels(varlen=varlen_stand_in("2.15")):
        trainer = make_trainer(True, **TRL_DEFAULT.trainer_options)
        with varlen_calls_counted() as kernel, attention_calls_counted(ATTN_IMPLEMENTATION) as attention:
            one_step(trainer)

    assert attention.calls == kernel.calls == 2 * trainer.model.config.num_hidden_layers
