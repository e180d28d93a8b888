"""Every bound the tests compare numbers with, beside the measured difference it bounds.

A measured bound is a few times the largest difference seen (tools/measure/, docs/concepts/exactness.md); "not
measured" marks the bounds no measurement is recorded for. No bound is tighter than the quantum of what it compares.
`_ATOL` bounds are absolute, `_RTOL` relative; the `_BY_MODEL` and `_BY_FAMILY` tables hold the models whose own
measured noise is above the shared bound. A bound used by one assert in one file stays beside it. The module imports
only `dataclasses`, so any script with tests/ on its path can read it.
"""

from dataclasses import dataclass, replace

# ---- Attention and forwards: no trainer -----------------------------------------------------------------------------

# fp32 attention against a dense reference (the varlen row, chunks of it under context parallelism, shared prefixes,
# image spans). Measured for `padfree_varlen` against float64 naive attention (tests/modeling/attention/test_attention.py): at most 4.1e-7
# (outputs) and 5.4e-7 (gradients). About twice that.
ATTENTION_ATOL = 1e-6
# Gradients of each attention parameter of the tiny models, packed vs eager per sequence, as a fraction of the largest
# gradient entry of that parameter: measured at most 1.25e-6 (gpt_oss sinks; gemma2 4.5e-7, llama4 1.1e-6)
ATTENTION_GRAD_RTOL = 3e-6
# bf16 inputs against a float32 or float64 reference (the CPU stand-ins and the CUDA kernels): not measured; bf16
# rounds each input by up to 2^-8 = 3.9e-3 relative
BF16_ATTENTION_ATOL, BF16_ATTENTION_RTOL = 2e-2, 2e-2

# Max abs difference of log-probs, packed vs per-sequence forwards, measured on 2 CPU cores (torch 2.13, transformers
# 5.23) over every model type, backend and seeds 0-4:
#   fp32: at most 9.5e-7 (2 ulp of a log-prob near -4.5), against the same backend and against eager; the same with
#         prefix sharing, shared vs unshared packed forward
#   bf16 (llama, mistral, gemma3_text): 0 (padfree_varlen, eager) and 3e-3 (sdpa) against the same backend, at most
#         5.8e-3 against eager. On an H200 (torch 2.11, docs/benchmarks.md) packed and per-sequence log-probs were
#         identical (both run the Flash kernel in bf16): the bound keeps the CPU headroom for other kernels and GPUs.
# A packed sequence that sees the ones before it is off by 0.09 (gpt2) to 0.5 (gemma3_text): see the leak test.
LOG_PROB_ATOL = 4e-6
BF16_LOG_PROB_ATOL = 1.5e-2
# Hybrid models (Mamba, delta-net, short convolutions): the packed forward equals each sequence alone within float32
# rounding, measured over the ten families: log-probs (around -5.7, one float32 step is 4.8e-7) at most 9.5e-7,
# gradients at most 2.4e-6 of the largest (Falcon-H1). The float64 twins of the architecture check put the same
# comparisons at 3e-8 to 6e-8 and 5e-8 to 3e-7.
HYBRID_LOG_PROB_ATOL = 3e-6
HYBRID_GRAD_ATOL = 6e-6  # times the largest gradient
# The fused LM head, fp32, measured on 16 pairs of each MoE model: its log-probs differ from log_softmax of the plain
# logits by at most 9.5e-7 (2 ulp of log-probs near -4.9: the head sums its vocabulary tiles in another order); losses
# differ from ln 2 + coef * aux by at most 2.2e-8, and TRL's aux loss equals the one from the plain forward's router
# logits exactly
FUSED_HEAD_LOG_PROB_ATOL = 2e-6
FUSED_HEAD_LOSS_ATOL = 1e-7

# ---- One step in one process, packed against TRL's padded step (trainer_utils.assert_same_step) ---------------------

# fp32, 3-5x the largest difference measured over every loss type and option (tools/measure/measure_noise.py,
# docs/concepts/exactness.md): loss 2e-7 relative, gradients 7e-7 of the largest gradient, metrics 1.1e-7 relative.
# Losses such as sppo_hard (~56 here) scale the rounding of ~60-token log-prob sums, so every bound grows with the
# padded magnitude.
LOSS_ATOL, LOSS_RTOL = 1e-6, 1e-6
GRAD_ATOL = 3e-6  # times max(1, largest padded gradient)
METRIC_RTOL, METRIC_ATOL = 5e-7, 1e-6
# fp32, one step, packed vs padded, largest gradient difference over the largest gradient: 2.3e-7 to 4.5e-7, except
# gemma4_text: 3.2e-6 (2.9e-6 absolute, largest gradient 0.91, the tied embedding; 3.3e-6 with its MoE block). TRL's
# padded trainer on the same gemma4_text model differs from itself by 1.4e-5 between its sdpa and eager attention:
# rounding, through six layers with sqrt(hidden)-scaled embeddings and per-layer inputs. Losses: at most 1.2e-7;
# metrics within the shared bounds.
GRAD_ATOL_BY_MODEL = {"gemma4_text": 1e-5}


@dataclass(frozen=True)
class Tolerances:
    """Bounds of one packed step against TRL's padded step: loss (absolute plus relative), gradients (times
    max(1, largest padded gradient)), metrics (absolute plus relative)."""

    loss_atol: float = LOSS_ATOL
    loss_rtol: float = LOSS_RTOL
    grad_atol: float = GRAD_ATOL
    metric_atol: float = METRIC_ATOL
    metric_rtol: float = METRIC_RTOL
    # Metrics not compared: in half precision `rewards/accuracies` counts pairs whose margin is within the rounding,
    # which TRL's own padded step flips between its sdpa and eager attention (gpt2, gpt_oss: 0.125 of 8 pairs)
    exempt_metrics: tuple[str, ...] = ()


FP32 = Tolerances()  # the fp32 step bounds above
# Half-precision steps against TRL's padded step in the same precision (tools/measure/measure_precision_noise.py,
# docs/concepts/exactness.md). TRL's own padded step moves between its sdpa and eager attention, over the 30 families
# of the suite, by at most 4e-4 in the loss, 2.9e-3 of the largest gradient (Gemma 3) and 8e-4 in the metrics, GPT-OSS
# and Gemma 4 apart (below); the packed step, through stand-ins that round as FA2 does (P and dS in bf16 before their
# products, grouped dK/dV per query head), moves from it by at most 1.7e-4, 2.2e-3 and 3.3e-4. The bounds: the loss
# at the bf16 spacing of a loss near 0.7 (2e-3, 5x the largest move), gradients at about 2x, metrics at about 10x.
HALF = Tolerances(
    loss_atol=2e-3,
    loss_rtol=0.0,
    grad_atol=5e-3,
    metric_atol=1e-3,
    metric_rtol=1e-2,
    # Counts, whose step (1/8 pairs, 1/82 tokens here) is above the metric bound: one near-tie flips them (GPT-OSS's
    # packed step through the sink correction: one of 82 tokens' argmax, at a loss 5e-6 and gradients 2.4e-4 away)
    exempt_metrics=("rewards/accuracies", "mean_token_accuracy"),
)
# Gemma 4 in half precision: TRL's own sdpa and eager runs differ by 5.6e-2 of its largest gradient (0.4 with bf16
# weights), the packed step by 9.4e-2 in TRL's default precision (its tiny twin; an ulp's change in the kernel's
# float32 arithmetic, such as dividing by the row sum before P.V, lands anywhere from 5e-2 to 0.34). GPT-OSS: TRL's own
# runs differ by 8.1e-3 (its sinks in eager), the packed step through the sink correction by 6.8e-3 at its real head
# dims (lm_head; tests/modeling/attention/test_fused_kernels.py)
HALF_GRAD_ATOL_BY_MODEL = {"gemma4_text": 0.15, "gpt_oss": 1.5e-2}
# Vision-language families at real head dims (tests/integration/vision/test_vision_kernels.py): TRL's own padded step moves further than
# HALF's gradient bound between its sdpa and eager attention (of the largest gradient, on the test's rows and the rows
# of seeds 1 and 2: tools/measure/measure_vision_precision_noise.py): each bound about twice that, the packed step's
# move beside it. Gemma 4's packed step, through the stand-in that rounds as FA2 does, is compared with padded sdpa,
# from which it moves least; its gradients swing with ulp-level changes of the kernel's arithmetic (0.05 to 0.38 over
# seeds)
HALF_GRAD_ATOL_BY_FAMILY = {
    # packed vs sdpa 0.38 (0.077, 0.073); packed vs eager 0.46 (0.12, 2.9); sdpa vs eager 0.15 (0.13, 0.89)
    "gemma4": 0.75,
    "gemma4_unified": 0.2,  # packed vs sdpa 0.097 (0.059, 0.079); packed vs eager 0.5 (0.94, 1.7)
    "shieldgemma2": 0.06,  # sdpa vs eager 0.024 (0.038, 0.025); packed 0.026 (0.03, 0.025)
    "hyperclovax_vision_v2": 0.02,  # sdpa vs eager 0.01 (0.01, 0.0061); packed 0.01 (0.011, 0.01)
    "janus": 0.01,  # sdpa vs eager 0.0024 (0.0044, 0.0039); packed 0.0054 (0.0039, 0.0044)
}
# Every layer on a fused kernel at real head dims (tests/modeling/attention/test_fused_kernels.py). GPT-OSS's gradients through the
# kernels' bf16 rounding (float32 queries and keys cast to bf16, the softmax rounded before it meets the values,
# normalised after): 6.7e-3 of the largest gradient from TRL's eager step, whose float32 softmax is normalised before
# its bf16 product; twice that. Gemma 2: 8e-4, within HALF.
FUSED_GRAD_ATOL_BY_MODEL = {"gpt_oss": 1.5e-2}
# The same rounding moves GPT-OSS's log-prob sums by 1.3e-2 (rewards by 1.3e-3: 3e-3 bounds them), and counts of
# near-tied logits flip, as `rewards/accuracies` does (exempt for every half-precision step): one of the random-weight
# twin's 82 completion tokens' argmax (mean_token_accuracy 0 -> 1/82)
FUSED_TOLERANCES_BY_MODEL = {
    "gpt_oss": replace(HALF, metric_atol=3e-3, exempt_metrics=(*HALF.exempt_metrics, "mean_token_accuracy")),
}
# bf16 autocast (TRL's bf16=True), packed vs padded, loss and log-prob sums: not measured; bf16 rounding of ~60-token
# sums is ~1e-2
BF16_AUTOCAST_LOSS_ATOL = 5e-3
BF16_AUTOCAST_LOGPS_RTOL = 2e-3
# On a CUDA GPU in bf16 (tests/integration/gpu/test_gpu_trainer.py): padding-free within this many times TRL's own sdpa-vs-eager
# difference, plus a floor for a noise near zero (absolute loss; gradient over the largest)
BF16_NOISE_FACTOR = 4.0
BF16_LOSS_FLOOR, BF16_GRAD_FLOOR = 2e-3, 2e-2
# The first loss of a policy equal to its reference: the log-ratios cancel and the loss is ln 2 (plus coef x the aux
# loss) up to float32 rounding (the float32 spacing near ln 2 is 6e-8); not measured
FIRST_LOSS_ATOL = 1e-6

# ---- Several steps in one process -----------------------------------------------------------------------------------

# SGD steps with accumulation, and sync_ref_model, packed vs padded losses: not measured; a step's bound (LOSS_ATOL)
# grows through the updates that follow it
TRAINING_LOSS_ATOL = 1e-4
# Evaluation metrics and the prediction step's logits, packed vs padded: not measured
EVAL_METRIC_RTOL, EVAL_METRIC_ATOL = 1e-5, 5e-5
PREDICTION_LOGITS_ATOL = 1e-4
# A run resumed from a checkpoint against the uninterrupted one, the same steps: not measured
RESUMED_LOSS_ATOL = 1e-6

# ---- Several processes against one, on the same global batches (distributed_runs.assert_same_training) --------------

# fp32. Measured under ZeRO-3 (2 processes vs 1, two AdamW steps): loss 2.3e-6; metrics 1.4e-7 to 1.1e-5 relative
# (grad_norm), rewards 4.6e-6 absolute (beta x log-ratios of ~0.3, so their margin cancels to 0.016). The tiny
# architectures of tests/integration/trainer/test_architectures_end_to_end.py (2 processes x 2 pairs, 3 AdamW steps, lr 1e-3): losses at
# most 3.9e-6 (olmo3; gemma4_text 2.1e-6, the MoE models <= 1.5e-6), aux_loss equal to 1e-6; metrics at most 0.46 of
# the bound (gemma4_text's grad_norm, 6.0e-4 of ~21); against padded TRL in the same ZeRO-3 launch: losses 3.2e-6,
# metrics 0.29 of the bound. Balanced batches over DDP, ZeRO-3 and FSDP2 on 2 and 4 processes: losses 1.9e-6,
# grad_norm 6.8e-6 relative, per-pair metrics 1.2e-5 relative. Each test file states what it measured under its engine.
DISTRIBUTED_LOSS_ATOL = 1e-5
DISTRIBUTED_METRIC_RTOL, DISTRIBUTED_METRIC_ATOL = 5e-5, 2e-5
# First-step gradients, two processes against one (token budget, split vision rows): not measured
DISTRIBUTED_GRAD_ATOL = 1e-5  # times max(1, largest one-process gradient)
# Gemma 4's third step, after two AdamW steps without clipping (--save-grads), moves grad_norm in fp32 by up to 6.7e-5
# relative (context parallelism with prefix sharing; 3.9e-5 padding-free in one process, no split), past
# DISTRIBUTED_METRIC_RTOL: its own bound, about twice that. Its losses and first-step gradients keep the shared bounds
DISTRIBUTED_METRIC_RTOL_BY_FAMILY = {"gemma4": 1.5e-4}
# bf16 engines (FSDP2's bf16 mixed precision, DeepSpeed's bf16), packed vs padded, both with float32 log-probs
# (`fp32_log_probs`, the default; tools/measure/measure_bf16_log_probs.py). The loss is then a float32 number (quantum
# 6e-8 near ln 2), and what separates the two is the decoder's bf16 arithmetic on differently shaped tensors. Measured
# on an AMD EPYC with AVX2 and no AVX-512 (`lscpu`), 2 processes, tiny Llama, 5 AdamW steps: loss 5.9e-4 (FSDP2) and
# 6.2e-4 (ZeRO-3), `rewards/margins` 1.2e-3, `logps/*` 1.3e-5 relative. Every bf16 kernel rounds its output once to
# bf16 (2^-9 relative), on AVX2 and AVX-512 alike: the spread is a sum of many such roundings, not one quantum, so the
# bounds are about 5x the measured maxima. With bf16 sums (TRL's precision under FSDP2) the same two runs were 0.045
# apart after one step: 15x the loss bound.
BF16_ENGINE_LOSS_ATOL = 3e-3
BF16_ENGINE_MARGIN_ATOL = 6e-3
BF16_ENGINE_LOGPS_RTOL = 1e-4
# bf16 weights, packed vs padded, both under ZeRO-3 (tests/integration/trainer/test_architectures_end_to_end.py): rounding in bf16 changes
# each AdamW update a little, and the difference grows with the steps. After two steps all but gemma4_text stay within
# 2e-2 (7.4e-4 when first measured); gemma4_text (gradient norm ~21) is 2.02e-2 off the padded run (transformers 5.24,
# DeepSpeed 0.19.8; the same in any run order). That is bf16's noise, not a leak: TRL's padded bf16 run is 0.040 off
# TRL's fp32 run at that step, the packed one 0.019 (fp32 runs equal within 2.1e-6). Its bound is 1.5 x TRL's own
# bf16-to-fp32 distance. The first step is exact (FIRST_LOSS_ATOL).
BF16_WEIGHTS_LOSS_ATOL = 2e-2
BF16_WEIGHTS_LOSS_ATOL_BY_MODEL = {"gemma4_text": 6e-2}
