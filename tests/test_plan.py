"""`trl-padfree plan`: units, DeepSpeed's estimators called as they are, the reference rules, the activation formula
against the tensors autograd really saves, the 34B case, and the command line."""

import json
import sys
from dataclasses import replace

import pytest
import torch

from trl_padfree.cli import main
from trl_padfree.plan import (
    GiB,
    ModelShape,
    Setup,
    activation_memory,
    cheapest_fix,
    estimate,
    layer_activation_bytes_per_token,
    load_model_shape,
    parse_count,
    parse_memory,
    policy_states,
    reference_memory,
    shape_of_config,
)
from trl_padfree.tiny import make_demo_model, make_model

deepspeed_stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
deepspeed_stage2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")

# Yi-1.5-34B's config.json (the fields that set its size): the known case of 34B on 8 x 80 GB GPUs
YI_34B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=7168,
    intermediate_size=20480,
    num_hidden_layers=60,
    num_attention_heads=56,
    num_key_value_heads=8,
    vocab_size=64000,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)
YI_34B_PARAMS = 34_388_917_248  # embedding and LM head 64000 x 7168 each, 60 layers of 557.8M, final norm
YI_34B_LARGEST_LAYER = 64000 * 7168


def write_config(directory, **fields) -> str:
    path = directory / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


def plan_json(tmp_path, *args: str) -> dict:
    output = tmp_path / "plan.json"
    assert main(["plan", *args, "--json", str(output)]) == 0
    return json.loads(output.read_text())


def exit_status(call) -> int:
    with pytest.raises(SystemExit) as exit_info:
        call()
    return exit_info.value.code


# ---------------------------------------------------------------------------------------------------------------------
# Units


@pytest.mark.parametrize(
    "text, count",
    [
        ("34.4B", 34_400_000_000),
        ("7e9", 7_000_000_000),
        ("500M", 500_000_000),
        ("1.5t", 1_500_000_000_000),
        ("123", 123),
    ],
)
def test_parse_count(text, count):
    assert parse_count(text) == count


@pytest.mark.parametrize(
    "text, num_bytes",
    [("80", 80 * GiB), ("80GiB", 80 * GiB), ("80GB", 80 * 10**9), ("512G", 512 * GiB), ("1.5TiB", 1536 * GiB)],
)
def test_parse_memory_bare_number_is_gib(text, num_bytes):
    assert parse_memory(text) == num_bytes


@pytest.mark.parametrize("text", ["lots", "80 GBs", "-1", "", "B"])
def test_bad_units_raise(text):
    with pytest.raises(ValueError):
        parse_memory(text)
    with pytest.raises(ValueError):
        parse_count(text)


# ---------------------------------------------------------------------------------------------------------------------
# Policy states: DeepSpeed's own estimators


@pytest.mark.parametrize(
    "params, largest, gpus_per_node, nodes, offload_optimizer, offload_param, zero_init",
    [
        (YI_34B_PARAMS, YI_34B_LARGEST_LAYER, 8, 1, False, False, True),
        (YI_34B_PARAMS, YI_34B_LARGEST_LAYER, 8, 2, True, False, True),
        (YI_34B_PARAMS, YI_34B_LARGEST_LAYER, 8, 4, True, True, False),
        (7_000_000_000, 131_072_000, 4, 1, False, False, False),
        (1_234_567, 4_321, 3, 5, True, True, True),
    ],
)
def test_zero3_policy_states_are_deepspeeds(
    params, largest, gpus_per_node, nodes, offload_optimizer, offload_param, zero_init
):
    shape = ModelShape("m", params, largest)
    setup = Setup(
        gpus_per_node,
        nodes,
        zero_stage=3,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        zero_init=zero_init,
    )
    cpu, gpu, _ = deepspeed_stage3.estimate_zero3_model_states_mem_needs(
        params, largest, gpus_per_node, nodes, offload_optimizer, offload_param, zero_init
    )
    assert policy_states(shape, setup) == (gpu, cpu)


@pytest.mark.parametrize(
    "params, gpus_per_node, nodes, offload_optimizer",
    [(YI_34B_PARAMS, 8, 1, False), (YI_34B_PARAMS, 8, 2, True), (7_000_000_000, 4, 1, True), (1_234_567, 3, 5, False)],
)
def test_zero2_policy_states_are_deepspeeds(params, gpus_per_node, nodes, offload_optimizer):
    shape = ModelShape("m", params, None)
    setup = Setup(gpus_per_node, nodes, zero_stage=2, offload_optimizer=offload_optimizer)
    cpu, gpu = deepspeed_stage2.estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, offload_optimizer)
    assert policy_states(shape, setup) == (gpu, cpu)


def test_zero1_adds_unpartitioned_gradients_and_stage0_is_16_bytes_per_param():
    shape = ModelShape("m", 7_000_000_000, None)
    zero2_gpu, zero2_cpu = policy_states(shape, Setup(4, 1, zero_stage=2))
    assert policy_states(shape, Setup(4, 1, zero_stage=1)) == (zero2_gpu + 2 * 7_000_000_000 * 3 // 4, zero2_cpu)
    assert policy_states(shape, Setup(4, 1, zero_stage=0)) == (16 * 7_000_000_000, 0)


def test_missing_deepspeed_names_the_install(monkeypatch):
    for module in ("deepspeed", "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match="pip install deepspeed"):
        policy_states(ModelShape("m", 10**9, 10**7), Setup())
    assert policy_states(ModelShape("m", 10**9, 10**7), Setup(zero_stage=0)) == (16 * 10**9, 0)


# ---------------------------------------------------------------------------------------------------------------------
# The reference model, which DeepSpeed's estimators leave out


@pytest.mark.parametrize(
    "stage, reference, precision, expected_gpu, expected_cpu",
    [
        (3, "gpu", "bf16", 2 * 10**9 // 16, 0),  # partitioned over all 16 GPUs
        (3, "offload", "bf16", 0, 2 * 10**9 // 2),  # pinned partitions, split over the 2 nodes
        (3, "precompute", "bf16", 0, 0),
        (2, "gpu", "fp16", 2 * 10**9, 0),  # TRL wraps it at stage 0 below ZeRO-3: a whole copy per GPU
        (0, "gpu", "fp32", 4 * 10**9, 0),
        (1, "precompute", "bf16", 0, 0),
    ],
)
def test_reference_memory(stage, reference, precision, expected_gpu, expected_cpu):
    setup = Setup(gpus_per_node=8, nodes=2, zero_stage=stage, reference=reference, precision=precision)
    assert reference_memory(ModelShape("m", 10**9, 10**7), setup) == (expected_gpu, expected_cpu)


# ---------------------------------------------------------------------------------------------------------------------
# Model shapes and activations


@pytest.mark.parametrize(
    "model_type, overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("gpt2", {})]
)
def test_meta_count_matches_deepspeeds_count_of_the_real_model(model_type, overrides):
    model = make_model(model_type, **overrides)
    shape = shape_of_config("tiny", model.config)
    assert (shape.total_params, shape.largest_layer_params) == deepspeed_stage3.model_to_params(model)


def test_demo_model_name_and_local_config_folder(tmp_path):
    demo = load_model_shape("trl-padfree/tiny-llama")
    assert demo.total_params == sum(parameter.numel() for parameter in make_demo_model("tiny", "llama").parameters())
    make_model("qwen3").config.save_pretrained(tmp_path)
    folder = load_model_shape(str(tmp_path))
    assert (folder.q_dim, folder.kv_dim, folder.gated_mlp) == (32, 16, True)


def _saved_activation_bytes(model, tokens: int) -> int:
    """Bytes of the tensors autograd keeps for the backward of the decoder layers, parameters left out."""
    storages = {}

    def keep(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    positions = torch.arange(tokens)[None]
    hidden = model.model.embed_tokens(torch.randint(4, 90, (1, tokens))).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        position_embeddings = model.model.rotary_emb(hidden, positions)
        for layer in model.model.layers:
            hidden = layer(hidden, position_embeddings=position_embeddings, position_ids=positions)
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    return sum(nbytes for pointer, nbytes in storages.items() if pointer not in parameters)


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "bf16"), (torch.float32, "fp32")])
def test_layer_activation_formula_matches_saved_tensors(dtype, precision):
    # One causal sequence through sdpa runs a flash kernel on CPU too: it keeps the output and log-sum-exp, no scores
    shape_fields = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4)
    model = make_model("llama", dtype=dtype, num_key_value_heads=2, **shape_fields)
    tokens = 301
    measured = _saved_activation_bytes(model, tokens) / (tokens * 3)
    shape = shape_of_config("tiny", model.config)
    # The formula leaves out per-token scalars (the norms' rsqrt, the attention's log-sum-exp): ~1% here
    assert layer_activation_bytes_per_token(shape, precision) == pytest.approx(measured, rel=0.03)


def test_activation_estimate_of_34b_by_hand(tmp_path):
    shape = load_model_shape(write_config(tmp_path, **YI_34B))
    tokens, h, i, kv, vocab = 4096, 7168, 20480, 1024, 64000
    layer = 2 * 6 * h + 2 * (h + 2 * h + 2 * kv) + 2 * h + 8 * i  # bf16, per token
    assert layer_activation_bytes_per_token(shape, "bf16") == layer == 311_296
    # Final norm and head input, one [4096, 32768] logits tile, fp32 hidden and head-weight gradients
    head = 8 * h * tokens + 2 * 4096 * 32768 + 4 * h * tokens + 6 * vocab * h
    checkpointed = 60 * 2 * h * tokens + 2 * layer * tokens + head
    assert activation_memory(shape, Setup(tokens=tokens)) == checkpointed  # ~8.8 GiB
    without = Setup(tokens=tokens, activation_checkpointing=False)
    assert activation_memory(shape, without) == 61 * layer * tokens + head  # ~75.6 GiB
    assert activation_memory(ModelShape("count only", 10**9, 10**7), Setup()) is None


# ---------------------------------------------------------------------------------------------------------------------
# The known case: 34B on 8 x 80 GB with ZeRO-3


def test_34b_on_8_gpus_zero3_does_not_fit(tmp_path, capsys):
    plan = plan_json(tmp_path, write_config(tmp_path, **YI_34B), "--gpus-per-node", "8", "--gpu-memory", "80")
    assert (plan["model"]["total_params"], plan["model"]["largest_layer_params"]) == (
        YI_34B_PARAMS,
        YI_34B_LARGEST_LAYER,
    )
    _, policy_gpu, _ = deepspeed_stage3.estimate_zero3_model_states_mem_needs(
        YI_34B_PARAMS, YI_34B_LARGEST_LAYER, 8, 1, False, False, True
    )
    current = plan["estimate"]
    assert current["policy_gpu"] == policy_gpu  # ~73.8 GiB: 18 bytes/param / 8, plus the largest layer in fp32
    assert current["reference_gpu"] == 2 * YI_34B_PARAMS // 8  # ~8.0 GiB
    assert current["policy_gpu"] + current["reference_gpu"] > 80 * GiB  # over before any activation
    assert not plan["fits"] and not current["gpu_fits"]
    assert plan["suggestion"]["changes"] and plan["suggestion"]["estimate"]["fits"]
    alternatives = {row["change"].split(" (")[0]: row["estimate"] for row in plan["alternatives"]}
    offloaded = alternatives["offload the reference to CPU"]
    assert offloaded["reference_cpu"] == 2 * YI_34B_PARAMS and offloaded["reference_gpu"] == 0
    printed = capsys.readouterr().out
    assert "does not fit" in printed and "Cheapest change that fits" in printed


def test_34b_with_reference_offload_costs_2p_of_cpu_per_node(tmp_path):
    config = write_config(tmp_path, **YI_34B)
    plan = plan_json(tmp_path, config, "--gpu-memory", "80GiB", "--reference", "offload", "--cpu-memory", "1TiB")
    current = plan["estimate"]
    assert current["reference_gpu"] == 0
    assert current["reference_cpu"] == 2 * YI_34B_PARAMS  # ~64 GiB on the one node
    assert current["cpu_total"] == current["policy_cpu"] + 2 * YI_34B_PARAMS and current["cpu_fits"]
    # The policy's states alone leave too little for activations and the reserve: the report says so, and what next
    assert not plan["fits"]
    suggestion = plan["suggestion"]
    assert suggestion["changes"] == ["offload the optimizer to CPU (offload_optimizer_device: cpu)"]
    assert suggestion["estimate"]["reference_cpu"] == 2 * YI_34B_PARAMS and suggestion["estimate"]["fits"]

    two_nodes = plan_json(tmp_path, config, "--reference", "offload", "--nodes", "2")
    assert two_nodes["estimate"]["reference_cpu"] == YI_34B_PARAMS  # each node holds its GPUs' partitions


# ---------------------------------------------------------------------------------------------------------------------
# The search for the cheapest change


def test_cheapest_change_prefers_cheap_changes_and_the_mildest_step():
    shape = ModelShape("m", 10**9, 10**7, 24, 2048, 5632, 2048, 512, 32000)
    base = Setup(gpus_per_node=1, zero_stage=0, tokens=16384, activation_checkpointing=False)

    def fix_with_memory_of(setup_that_fits: Setup) -> tuple[list[str], Setup]:
        """The cheapest fix of `base` on GPUs with exactly the memory `setup_that_fits` needs."""
        needed = estimate(shape, setup_that_fits).gpu_total
        changes, fixed, result = cheapest_fix(shape, replace(base, gpu_memory=needed), min_tokens=1024)
        assert result.fits
        return [change.family for change in changes], fixed

    # Precomputing the reference log-probs costs nothing per step: it comes before offloading the reference
    families, fixed = fix_with_memory_of(replace(base, reference="precompute"))
    assert families == ["reference"] and fixed.reference == "precompute"
    # Checkpointing alone fits: no token cut, no offload
    families, fixed = fix_with_memory_of(replace(base, activation_checkpointing=True))
    assert families == ["activation checkpointing"]
    # A cheap change is added before a dear one goes further: precompute + 8192 tokens, not 4096 tokens alone
    families, fixed = fix_with_memory_of(
        replace(base, activation_checkpointing=True, reference="precompute", tokens=8192)
    )
    assert families == ["reference", "activation checkpointing", "fewer tokens"] and fixed.tokens == 8192


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def test_tiny_config_fits_and_json_schema(tmp_path):
    make_model("llama").config.save_pretrained(tmp_path)
    plan = plan_json(tmp_path, str(tmp_path / "config.json"), "--gpus-per-node", "2", "--gpu-memory", "24GB")
    assert set(plan) == {"model", "setup", "estimate", "fits", "suggestion", "alternatives", "notes"}
    assert set(plan["estimate"]) == {
        "policy_gpu",
        "reference_gpu",
        "activations_gpu",
        "reserve_gpu",
        "gpu_total",
        "gpu_memory",
        "policy_cpu",
        "reference_cpu",
        "cpu_total",
        "cpu_memory",
        "gpu_fits",
        "cpu_fits",
        "fits",
    }
    assert plan["setup"]["gpu_memory"] == 24 * 10**9 and plan["setup"]["gpus_per_node"] == 2
    assert plan["fits"] and plan["suggestion"] is None and plan["alternatives"] == []
    assert plan["estimate"]["activations_gpu"] > 0 and plan["estimate"]["cpu_fits"] is None


def test_parameter_count_plans_without_activations(tmp_path, capsys):
    plan = plan_json(tmp_path, "7e9", "--zero-stage", "2", "--gpus-per-node", "4")
    assert plan["model"]["total_params"] == 7 * 10**9 and plan["estimate"]["activations_gpu"] is None
    assert "not estimated" in capsys.readouterr().out
    plan = plan_json(tmp_path, "7B", "--largest-layer", "131M")
    assert plan["estimate"]["policy_gpu"] == policy_states(ModelShape("m", 7 * 10**9, 131 * 10**6), Setup())[0]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["34B", "--gpu-memory", "lots"], "--gpu-memory"),
        (["34B", "--reference", "somewhere"], "--reference"),
        (["34B"], "--largest-layer"),  # ZeRO-3 without a layer count
        (["34B", "--zero-stage", "2", "--reference", "offload"], "--zero-stage 3"),
        (["34B", "--zero-stage", "2", "--offload-param", "--offload-optimizer"], "--offload-param"),
        (["34B", "--zero-stage", "2", "--precision", "fp32"], "bf16"),
        (["trl-padfree/huge-llama"], "huge-llama"),
        (["no-such-org/no-such-model"], "no-such-model"),
    ],
)
def test_bad_plan_arguments_are_one_line_errors(args, expected, capsys):
    assert exit_status(lambda: main(["plan", *args])) == 2
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in stderr, stderr
    assert expected in lines[0]
