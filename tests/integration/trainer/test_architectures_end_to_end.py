"""Today's architectures end to end: tiny models built from their default configs (tests/support/tiny_architectures.py) train
padding-free exactly like TRL's padded trainer, in one process and under DeepSpeed ZeRO-3 on two CPU processes.

    one process, fp32     one step: loss, every parameter's gradient, every TRL metric, packed vs padded
    ZeRO-3, fp32          3 AdamW steps on 2 processes x 2 pairs: losses and metrics vs TRL padded in one process on
                          the same global batches, and vs TRL padded under the same ZeRO-3 launch
    ZeRO-3, bf16 weights  3 steps: parameters bf16 and partitioned, losses finite, the first one exact, and near TRL
                          padded under ZeRO-3 (-m slow, a launch of their own)

The MoE models keep their config's router_aux_loss_coef (0.001: TRL's aux loss is on); qwen3_moe and mixtral run with
0.05 under ZeRO-3 for the aux-loss comparison of tests/integration/trainer/test_moe_aux_loss.py. The fp32 ZeRO-3 runs share one
`accelerate launch`, one after the other in the same two processes.
"""

import functools
import math
from pathlib import Path

import pytest
from tiny_architectures import make_tiny_model
from tiny_fixtures import make_tokenizer
from tolerances import (
    BF16_WEIGHTS_LOSS_ATOL,
    BF16_WEIGHTS_LOSS_ATOL_BY_MODEL,
    DISTRIBUTED_LOSS_ATOL,
    DISTRIBUTED_METRIC_ATOL,
    DISTRIBUTED_METRIC_RTOL,
    FIRST_LOSS_ATOL,
    GRAD_ATOL,
    GRAD_ATOL_BY_MODEL,
)
from trainer_utils import assert_same_step, make_trainer, one_step

from trl_padfree import ATTN_IMPLEMENTATION

deepspeed = pytest.importorskip("deepspeed")

from distributed_runs import ROOT, launch, save_tiny_models, single_process_padded_fixture  # noqa: E402

MODEL_TYPES = ("qwen3_moe", "gemma4_text", "gpt_oss", "llama4_text", "olmo3")
# Whose config turns TRL's MoE aux loss on (a nonzero router_aux_loss_coef)
AUX_LOSS_BY_DEFAULT = ("qwen3_moe", "gpt_oss", "llama4_text")


def model_factory(model_type: str, **overrides):
    return functools.partial(make_tiny_model, model_type, len(make_tokenizer()), **overrides)


# What each tiny model must keep of its architecture: attention kinds (layer_types), MLP classes per layer
LAYER_KINDS = {
    "qwen3_moe": (None, ["Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]),
    "gemma4_text": ({"sliding_attention", "full_attention"}, ["Gemma4TextMLP"] * 6),
    "gpt_oss": ({"sliding_attention", "full_attention"}, ["GptOssMLP"] * 2),
    "llama4_text": ({"chunked_attention", "full_attention"}, ["Llama4TextMLP", "Llama4TextMoe"] * 2),
    "olmo3": ({"sliding_attention", "full_attention"}, ["Olmo3MLP"] * 4),
}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tiny_model_keeps_the_architecture(model_type):
    model = make_tiny_model(model_type, len(make_tokenizer()))
    layer_types, mlps = LAYER_KINDS[model_type]
    assert (set(model.config.layer_types) if layer_types else None) == layer_types
    assert [type(getattr(layer, "mlp", None) or layer.feed_forward).__name__ for layer in model.model.layers] == mlps
    if model_type == "llama4_text":  # RoPE on the chunked layers only
        assert model.config.no_rope_layers == [1, 1, 1, 0]
    if model_type == "gemma4_text":  # wider heads on the full-attention layer, per-layer inputs
        assert model.model.layers[5].self_attn.head_dim == 2 * model.model.layers[0].self_attn.head_dim
        assert model.config.hidden_size_per_layer_input > 0
    assert all(parameter.any() for parameter in model.parameters())  # gpt_oss's sinks and biases too


# Gemma 4's MoE variant (26B-A4B): a routed MoE block next to the dense MLP of every layer (its config declares no
# router_aux_loss_coef, so TRL adds no aux loss)
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


@pytest.mark.parametrize(
    "model_type, overrides",
    [*((model_type, {}) for model_type in MODEL_TYPES), ("gemma4_text", GEMMA4_MOE)],
    ids=[*MODEL_TYPES, "gemma4_text-moe"],
)
def test_one_step_matches_padded(model_type, overrides):
    padded_trainer = make_trainer(False, model_factory=model_factory(model_type, **overrides))
    packed_trainer = make_trainer(True, model_factory=model_factory(model_type, **overrides))
    assert packed_trainer.model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert packed_trainer.aux_loss_enabled == (model_type in AUX_LOSS_BY_DEFAULT)
    padded, packed = one_step(padded_trainer), one_step(packed_trainer)
    assert_same_step(padded, packed, grad_atol=GRAD_ATOL_BY_MODEL.get(model_type, GRAD_ATOL))


# ZeRO-3 on two CPU processes

PAIRS_PER_PROCESS = 2
STEPS = 3
AUX_LOSS_COEF = {"aux": 0.05, "": 0.001}  # train_dpo.py's AUX_LOSS_COEF, and the configs' own
# Options of each fp32 model's runs: qwen3_moe and mixtral with a large aux loss (tests/integration/trainer/test_moe_aux_loss.py)
FP32_OPTIONS = {"qwen3_moe": "aux", "mixtral": "aux", "gemma4_text": "", "gpt_oss": "", "llama4_text": "", "olmo3": ""}


def padded_trainer(model_type: str) -> str:
    # TRL's own trainer, padded; Llama4ForCausalLM needs the fused LM head's lookups fixed (fused_lm_head.py), so its
    # padded runs use this package's trainer with padding_free=False (TRL's trainer otherwise, see test_trainer.py)
    return "padded" if model_type == "llama4_text" else "trl"


def run_name(model_type: str, trainer: str, *options: str) -> str:
    return f"{model_type}:" + "+".join(option for option in (trainer, *options) if option)


def packed_run(model_type):
    return run_name(model_type, "padding_free", FP32_OPTIONS[model_type])


def padded_run(model_type):
    return run_name(model_type, padded_trainer(model_type), FP32_OPTIONS[model_type])


def bf16_run(model_type, trainer="padding_free"):
    return run_name(model_type, trainer, "bf16", "bf16_weights")


ZERO3_RUNS = [run for model_type in FP32_OPTIONS for run in (packed_run(model_type), padded_run(model_type))]

# Metrics defined alike whether two processes or two accumulated micro-batches make the step: means over pairs,
# the gradient norm, the token count, and the aux loss (each process's, or each micro-batch's, averaged)
DATA_PARALLEL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                         "num_tokens", "grad_norm", "aux_loss")  # fmt: skip
# Token-weighted means: over both processes' tokens at once, but per micro-batch under accumulation
TOKEN_METRICS = ("logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    return save_tiny_models(tmp_path_factory.mktemp("architectures"), FP32_OPTIONS)


@pytest.fixture(scope="module")
def zero3_runs(models_dir, tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("zero3") / "report.json"
    options = ("--runs", ",".join(ZERO3_RUNS), "--batch-size", str(PAIRS_PER_PROCESS), "--steps", str(STEPS))
    return launch("zero3.yaml", models_dir, output, *options)


# Each step the two processes' micro-batches accumulated: the load-balancing loss is not a mean over pairs, so a step of
# 4 pairs in one micro-batch would have another aux loss than 2 x 2 pairs
single_process_padded = single_process_padded_fixture(
    {padded_run(model_type): padded_run(model_type) for model_type in FP32_OPTIONS},
    *("--batch-size", str(PAIRS_PER_PROCESS), "--grad-accum", "2", "--steps", str(STEPS)),
    models="models_dir",
)


def assert_ran_under_zero3(report: dict) -> None:
    assert report["world_size"] == 2 and report["zero_stage"] == 3
    assert report["policy_sharded"]  # every parameter partitioned (ds_tensor), each process holding part of it
    assert Path(report["trl_padfree"]).is_relative_to(ROOT)  # this checkout's package ran, not an installed copy
    assert len(report["losses"]) == STEPS and all(math.isfinite(loss) for loss in report["losses"])


def assert_first_loss_is_ln2_plus_aux(report: dict, coef: float) -> None:
    # The reference starts equal to the policy: the DPO loss is ln 2, plus coef x the policy's aux loss
    aux_loss = report["metrics"][0].get("aux_loss", 0.0) if report["aux_loss_enabled"] else 0.0
    assert report["losses"][0] == pytest.approx(math.log(2) + coef * aux_loss, abs=FIRST_LOSS_ATOL)


def assert_same_metrics(report: dict, expected: dict, keys) -> None:
    # A key logged by one run only (aux_loss) fails with a KeyError
    for step, (metrics, expected_metrics) in enumerate(zip(report["metrics"], expected["metrics"], strict=True)):
        for key in (key for key in keys if key in metrics or key in expected_metrics):
            assert metrics[key] == pytest.approx(
                expected_metrics[key], rel=DISTRIBUTED_METRIC_RTOL, abs=DISTRIBUTED_METRIC_ATOL
            ), (step, key)


@pytest.mark.parametrize("model_type", FP32_OPTIONS)
def test_zero3_matches_padded_trl(model_type, zero3_runs, single_process_padded):
    packed, padded_zero3 = zero3_runs[packed_run(model_type)], zero3_runs[padded_run(model_type)]
    single = single_process_padded[padded_run(model_type)]
    assert_ran_under_zero3(packed)
    assert packed["attn_implementation"] == ATTN_IMPLEMENTATION and packed["dtype"] == "torch.float32"
    assert packed["aux_loss_enabled"] == (model_type in AUX_LOSS_BY_DEFAULT or FP32_OPTIONS[model_type] == "aux")
    assert_first_loss_is_ln2_plus_aux(packed, AUX_LOSS_COEF[FP32_OPTIONS[model_type]])
    assert packed["metrics"][0]["padfree/padding_removed"] > 0
    assert_ran_under_zero3(padded_zero3)
    assert "padfree/padding_removed" not in padded_zero3["metrics"][0]  # TRL's padded path

    assert packed["losses"] == pytest.approx(single["losses"], abs=DISTRIBUTED_LOSS_ATOL)
    assert_same_metrics(packed, single, DATA_PARALLEL_METRICS)
    assert packed["losses"] == pytest.approx(padded_zero3["losses"], abs=DISTRIBUTED_LOSS_ATOL)
    assert_same_metrics(packed, padded_zero3, DATA_PARALLEL_METRICS + TOKEN_METRICS)


# bf16 weights, packed and padded, in a launch of their own with -m slow (the default suite's time: 5 bf16 runs on CPU
# cost about as much as the 12 fp32 ones); DeepSpeed's bf16 under ZeRO-3 stays in the default suite on Llama
# (test_deepspeed.py)
@pytest.fixture(scope="module")
def zero3_bf16_runs(models_dir, tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("zero3_bf16") / "report.json"
    runs = [
        run
        for model_type in MODEL_TYPES
        for run in (bf16_run(model_type), bf16_run(model_type, padded_trainer(model_type)))
    ]
    options = ("--runs", ",".join(runs), "--batch-size", str(PAIRS_PER_PROCESS), "--steps", str(STEPS))
    return launch("zero3.yaml", models_dir, output, *options)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_zero3_trains_bf16_weights(model_type, zero3_bf16_runs):
    report = zero3_bf16_runs[bf16_run(model_type)]
    assert_ran_under_zero3(report)
    assert report["dtype"] == "torch.bfloat16" and report["attn_implementation"] == ATTN_IMPLEMENTATION
    assert_first_loss_is_ln2_plus_aux(report, AUX_LOSS_COEF[""])
    assert report["losses"][1] != report["losses"][0]  # the step changed the policy


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_zero3_bf16_weights_match_padded_bf16(model_type, zero3_bf16_runs):
    packed, padded = (
        zero3_bf16_runs[bf16_run(model_type)],
        zero3_bf16_runs[bf16_run(model_type, padded_trainer(model_type))],
    )
    assert_ran_under_zero3(padded)
    assert padded["dtype"] == "torch.bfloat16"
    assert packed["losses"][0] == pytest.approx(padded["losses"][0], abs=FIRST_LOSS_ATOL)
    assert packed["losses"] == pytest.approx(
        padded["losses"], abs=BF16_WEIGHTS_LOSS_ATOL_BY_MODEL.get(model_type, BF16_WEIGHTS_LOSS_ATOL)
    )
