"""`trl-padfree plan`: units, DeepSpeed's estimators called as they are, the reference rules, the activation formula
against the tensors autograd really saves, the 34B case, FSDP2 by hand and against accelerate's own sharding, context
parallelism by hand, and the command line."""

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from distributed_runs import checkout_environment, free_port
from tiny_fixtures import make_model

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
from trl_padfree.plan.fsdp2 import kept_gathered_params
from trl_padfree.tiny import make_demo_model

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
# One Yi-34B decoder layer: q and o 7168 x 7168, k and v 7168 x 1024, gate, up and down 7168 x 20480, two norms
YI_34B_DECODER_LAYER = 2 * 7168 * 7168 + 2 * 7168 * 1024 + 3 * 7168 * 20480 + 2 * 7168
YI_34B_HEAD = 64000 * 7168 + 7168  # FSDP2's tail unit: the LM head and the final norm
FSDP2 = dict(fsdp2=True, zero_stage=None)


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
# FSDP2


def test_fsdp2_units_of_34b_from_its_config(tmp_path):
    shape = load_model_shape(write_config(tmp_path, **YI_34B))
    assert shape.decoder_layer_params == YI_34B_DECODER_LAYER == 557_856_768
    assert shape.non_layer_params == YI_34B_LARGEST_LAYER + YI_34B_HEAD  # the embedding and the tail
    assert not shape.tied_embeddings and kept_gathered_params(shape) == YI_34B_HEAD


def test_fsdp2_34b_on_8_gpus_by_hand(tmp_path):
    shape = load_model_shape(write_config(tmp_path, **YI_34B))
    # fp32 weights, gradients and Adam shards; two bf16 layers and the tail gathered; two layer-sized bf16 gradient
    # buffers (the unsharded gradients and the reduce-scatter input)
    sharded = 16 * YI_34B_PARAMS // 8
    gathered = 2 * (2 * YI_34B_DECODER_LAYER + YI_34B_HEAD)
    buffers = 2 * 2 * YI_34B_DECODER_LAYER
    assert policy_states(shape, Setup(**FSDP2)) == (sharded + gathered + buffers, 0)  # ~64.1 + 2.9 + 2.1 GiB
    # The reference: bf16 shards. Its forward gathers its embedding and head (0.9B) besides two layers, less than the
    # policy's gathered layers and gradient buffers (4 layers' worth of bf16), which it precedes: nothing more counted
    assert reference_memory(shape, Setup(**FSDP2)) == (2 * YI_34B_PARAMS // 8, 0)
    result = estimate(shape, Setup(**FSDP2))
    assert result.gpu_total == sharded + gathered + buffers + 2 * YI_34B_PARAMS // 8 + result.activations_gpu + 3 * GiB
    assert not result.fits  # 94.9 GiB of 80


def test_fsdp2_offload_moves_the_shards_to_cpu(tmp_path):
    shape = load_model_shape(write_config(tmp_path, **YI_34B))
    for nodes in (1, 2):
        kept = estimate(shape, Setup(nodes=nodes, **FSDP2))
        offloaded = estimate(shape, Setup(nodes=nodes, fsdp_offload_params=True, **FSDP2))
        total_gpus = 8 * nodes
        # The policy's 16 bytes/param of shards: off each GPU, onto the node that GPU is in
        assert kept.policy_gpu - offloaded.policy_gpu == 16 * YI_34B_PARAMS // total_gpus
        assert offloaded.policy_cpu - kept.policy_cpu == 8 * (16 * YI_34B_PARAMS // total_gpus)
        # The reference follows the policy's offload policy: its bf16 shards move too
        assert (offloaded.reference_gpu, offloaded.reference_cpu) == (0, 2 * YI_34B_PARAMS // nodes)
        assert kept.activations_gpu == offloaded.activations_gpu  # same packed micro-batch


def test_fsdp2_reference_offload_is_accepted_and_still_refused_with_zero2(tmp_path):
    shape = load_model_shape(write_config(tmp_path, **YI_34B))
    on_gpus, offloaded = (reference_memory(shape, Setup(reference=place, **FSDP2)) for place in ("gpu", "offload"))
    assert on_gpus == (2 * YI_34B_PARAMS // 8, 0)
    assert offloaded == (0, 2 * YI_34B_PARAMS)  # pinned bf16 shards of the node's 8 GPUs: the whole model
    assert reference_memory(shape, Setup(nodes=2, reference="offload", **FSDP2)) == (0, YI_34B_PARAMS)
    assert reference_memory(shape, Setup(reference="precompute", **FSDP2)) == (0, 0)
    # The policy is untouched by where the reference goes
    assert policy_states(shape, Setup(reference="offload", **FSDP2)) == policy_states(shape, Setup(**FSDP2))
    with pytest.raises(ValueError, match="--zero-stage 3 or --fsdp2"):
        estimate(shape, Setup(zero_stage=2, reference="offload"))


def test_fsdp2_reference_counts_the_embeddings_its_forward_gathers_beyond_the_policys_peak():
    # Llama-3.1-8B's sizes: untied 128256 x 4096 embedding and head, 32 layers of 218,112,000
    embedding, layer = 128256 * 4096, 218_112_000
    non_layer = 2 * embedding + 4096
    shape = ModelShape(
        "8b-like",
        8_030_261_248,
        embedding,
        decoder_layer_params=layer,
        non_layer_params=non_layer,
        input_embedding_params=embedding,
    )
    # Its forward gathers 2 layers + embeddings + head; by then the policy holds its tail, not its 2 layers and the
    # 2 layers' worth of gradient buffers: the excess is 2 bytes x (embeddings + head - 2 layers), ~1.1 GiB
    excess = 2 * (non_layer - 2 * layer)
    assert reference_memory(shape, Setup(**FSDP2)) == (2 * 8_030_261_248 // 8 + excess, 0)
    assert reference_memory(shape, Setup(reference="offload", **FSDP2)) == (excess, 2 * 8_030_261_248)
    # Tied, one matrix serves both and sits in the policy's tail unit, which stays gathered
    tied = replace(
        shape, total_params=8_030_261_248 - embedding, non_layer_params=embedding + 4096, tied_embeddings=True
    )
    assert kept_gathered_params(tied) == embedding + 4096
    assert reference_memory(tied, Setup(**FSDP2))[0] == 2 * tied.total_params // 8 + 2 * (embedding + 4096 - 2 * layer)


def test_fsdp2_plan_searches_only_fsdp2_changes(tmp_path, capsys):
    plan = plan_json(tmp_path, write_config(tmp_path, **YI_34B), "--fsdp2")
    assert plan["engine"] == "fsdp2" and plan["setup"]["zero_stage"] is None
    assert plan["accelerate_config"] == {"file": "fsdp2", "changes": {}}
    assert not plan["fits"]
    changes = [row["change"] for row in plan["alternatives"]]
    assert not any("ZeRO" in change or "_device" in change for change in changes), changes
    offloaded = next(row["estimate"] for row in plan["alternatives"] if "fsdp_offload_params: true" in row["change"])
    assert offloaded["policy_cpu"] == 16 * YI_34B_PARAMS and offloaded["fits"]
    suggestion = plan["suggestion"]
    assert (
        suggestion["setup"]["fsdp2"] and suggestion["setup"]["zero_stage"] is None and suggestion["estimate"]["fits"]
    )
    printed = capsys.readouterr().out
    assert "FSDP2 (fully_shard per decoder layer)" in printed
    assert "Config --accelerate_config fsdp2" in printed and "FSDP2 policy per GPU:" in printed


def test_fsdp2_config_changes_follow_the_offloads(tmp_path, capsys):
    config = write_config(tmp_path, **YI_34B)
    plan = plan_json(tmp_path, config, "--fsdp2", "--reference", "offload", "--cpu-memory", "1TiB")
    assert plan["accelerate_config"] == {"file": "fsdp2", "changes": {}}
    assert plan["estimate"]["reference_gpu"] == 0 and plan["estimate"]["reference_cpu"] == 2 * YI_34B_PARAMS
    assert "Config --accelerate_config fsdp2" in capsys.readouterr().out
    plan = plan_json(tmp_path, config, "--fsdp2", "--fsdp2-offload-params", "--gpus-per-node", "4")
    assert plan["accelerate_config"] == {
        "file": "fsdp2",
        "changes": {"fsdp_offload_params": True},
    }
    assert plan["estimate"]["policy_cpu"] == 4 * (16 * YI_34B_PARAMS // 4)
    assert "Config --accelerate_config fsdp2, with fsdp_offload_params: true" in capsys.readouterr().out


# accelerate runs FSDP only on GPUs: its `fsdp2_prepare_model` is called directly, on CPU in a gloo world of one, with
# the attributes of an Accelerator it reads. In a fresh process, as accelerate's state is a process-wide singleton
FSDP2_PROBE = """\
import json, sys, types

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

dist.init_process_group("gloo", rank=0, world_size=1)
PartialState()
report = {}
for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
        cpu_ram_efficient_loading=False,
    )
    plugin.set_mixed_precision("bf16")  # what `mixed_precision: bf16` makes accelerate do
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16", is_main_process=True,
        device=torch.device("cpu"),
    )
    model = fsdp2_prepare_model(accelerator, model)
    sharded_dtypes = {str(parameter.dtype) for parameter in model.parameters()}
    # After a forward, a unit that reshards holds DTensor shards again; one kept gathered holds plain tensors
    model(torch.arange(7)[None]).logits.float().sum().backward()
    report[folder] = {
        "sharded_dtypes": sorted(sharded_dtypes),
        "gradient_dtypes": sorted({str(parameter.grad.dtype) for parameter in model.parameters()}),
        "param_dtype": str(plugin.mixed_precision_policy.param_dtype),
        "reduce_dtype": str(plugin.mixed_precision_policy.reduce_dtype),
    }
    model.zero_grad()
    model(torch.arange(7)[None])
    report[folder]["gathered_after_forward"] = sum(
        parameter.numel() for parameter in model.parameters() if not isinstance(parameter, DTensor)
    )
dist.destroy_process_group()
print("FSDP2 " + json.dumps(report))
"""


def test_fsdp2_units_and_dtypes_are_accelerates(tmp_path):
    """What the planner assumes of FSDP2, checked against accelerate's own preparation of tiny models: the units kept
    gathered after a forward (tail and root, untied embedding freed), fp32 shards and gradients, bf16 compute and
    reduction."""
    cases = {"llama": {}, "qwen2": {"tie_word_embeddings": True}, "gpt2": {}}  # untied, tied, a root leftover
    folders = {}
    for model_type, overrides in cases.items():
        config = make_model(model_type, **overrides).config
        config.save_pretrained(tmp_path / model_type)
        folders[str(tmp_path / model_type)] = shape_of_config(model_type, config)
    environment = checkout_environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run = subprocess.run(
        [sys.executable, "-c", FSDP2_PROBE, *folders], env=environment, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("FSDP2 ")]
    assert run.returncode == 0 and lines, run.stdout + run.stderr
    report = json.loads(lines[0].removeprefix("FSDP2 "))
    for folder, shape in folders.items():
        measured = report[folder]
        assert measured["gathered_after_forward"] == kept_gathered_params(shape), shape.name
        assert measured["sharded_dtypes"] == measured["gradient_dtypes"] == ["torch.float32"], shape.name
        assert measured["param_dtype"] == measured["reduce_dtype"] == "torch.bfloat16", shape.name


# ---------------------------------------------------------------------------------------------------------------------
# Context parallelism: C GPUs share each row, each runs T / C tokens and gathers the whole row's keys and values


def test_context_parallel_activations_and_row_buffers_of_34b_by_hand(tmp_path):
    shape = load_model_shape(write_config(tmp_path, **YI_34B))
    row, kv, layers = 65536, 8 * 128, 60
    whole_row = Setup(tokens=row)
    shared = estimate(shape, Setup(tokens=row, context_parallel_size=4))
    # Everything but attention runs on the GPU's 16384 tokens: the activation estimate of 16384 tokens
    assert shared.activations_gpu == activation_memory(shape, Setup(tokens=16384))
    # The row's keys and values, 2 x 65536 x 1024 x 2 bytes = 256 MiB: gathered, indexed for the kernel, gradients
    row_kv = 2 * row * kv * 2
    assert row_kv == 256 * 2**20 and shared.context_parallel_gpu == 3 * row_kv
    # The model states do not change: ZeRO partitions over every GPU, whatever shares the rows
    alone = estimate(shape, whole_row)
    assert (shared.policy_gpu, shared.reference_gpu, shared.cpu_total) == (
        alone.policy_gpu,
        alone.reference_gpu,
        alone.cpu_total,
    )
    assert shared.gpu_total == shared.policy_gpu + shared.reference_gpu + shared.activations_gpu + 3 * row_kv + 3 * GiB
    assert alone.context_parallel_gpu == 0 and alone.gpu_total - shared.gpu_total > 3 * GiB  # 14.3 vs 6.8 GiB
    # Without checkpointing every layer keeps its copies until its backward: L + 2 row buffers
    unchecked = estimate(shape, Setup(tokens=row, context_parallel_size=4, activation_checkpointing=False))
    assert unchecked.context_parallel_gpu == (layers + 2) * row_kv
    # A row that is no multiple of the group is padded to one: 16385 tokens each, a row of 65540
    padded = estimate(shape, Setup(tokens=row + 1, context_parallel_size=4))
    assert padded.activations_gpu == activation_memory(shape, Setup(tokens=16385))
    assert padded.context_parallel_gpu == 3 * 2 * 65540 * kv * 2


@pytest.mark.parametrize(
    "engine",
    [dict(zero_stage=3), dict(zero_stage=3, offload_optimizer=True, offload_param=True), dict(zero_stage=2),
     dict(zero_stage=0), FSDP2, dict(fsdp_offload_params=True, **FSDP2)],
    ids=["zero3", "zero3-offload", "zero2", "ddp", "fsdp2", "fsdp2-offload"],
)  # fmt: skip
def test_context_parallel_under_every_engine_adds_the_same_buffers(tmp_path, engine):
    shape = load_model_shape(write_config(tmp_path, **YI_34B))
    alone, shared = (estimate(shape, Setup(nodes=2, context_parallel_size=size, **engine)) for size in (1, 16))
    assert shared.context_parallel_gpu == 3 * 2 * 8192 * 1024 * 2  # the default 8192-token row, across two nodes
    assert shared.activations_gpu == activation_memory(shape, Setup(tokens=512))
    assert (shared.policy_gpu, shared.reference_gpu) == (alone.policy_gpu, alone.reference_gpu)


def test_context_parallel_without_a_layer_shape_is_not_estimated():
    result = estimate(ModelShape("count only", 10**9, 10**7), Setup(context_parallel_size=2))
    assert result.activations_gpu is None and result.context_parallel_gpu is None
    assert result.gpu_total == result.policy_gpu + result.reference_gpu + result.reserve_gpu


def test_context_parallel_in_the_report_and_the_json(tmp_path, capsys):
    config = write_config(tmp_path, **YI_34B)
    plan = plan_json(tmp_path, config, "--tokens", "65536", "--context-parallel", "4", "--reference", "precompute")
    assert plan["setup"]["context_parallel_size"] == 4 and plan["setup"]["tokens"] == 65536
    assert plan["estimate"]["context_parallel_gpu"] == 3 * 2 * 65536 * 1024 * 2
    printed = capsys.readouterr().out
    assert "65536 tokens per micro-batch row, 16384 on each of 4 GPUs (context parallelism)" in printed
    assert "activations of 16384 tokens, 1/4 of the row (estimate)" in printed
    assert re.search(r"context-parallel K/V buffers of the whole row \(estimate\) +0\.8\n", printed)
    assert "Note: Context parallelism: each GPU runs 16384 of the row's tokens" in printed
    # Without it the report is as before: no buffer line, and 0 bytes in the JSON
    plan = plan_json(tmp_path, config, "--tokens", "65536", "--reference", "precompute")
    assert plan["setup"]["context_parallel_size"] == 1 and plan["estimate"]["context_parallel_gpu"] == 0
    printed = capsys.readouterr().out
    assert "context-parallel" not in printed.lower() and "65536 tokens per micro-batch;" in printed


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def test_tiny_config_fits_and_json_schema(tmp_path):
    make_model("llama").config.save_pretrained(tmp_path)
    plan = plan_json(tmp_path, str(tmp_path / "config.json"), "--gpus-per-node", "2", "--gpu-memory", "24GB")
    assert set(plan) == {
        "model",
        "setup",
        "engine",
        "accelerate_config",
        "estimate",
        "fits",
        "suggestion",
        "alternatives",
        "notes",
    }
    assert plan["engine"] == "deepspeed" and plan["accelerate_config"] is None  # DeepSpeed reports name no config
    assert set(plan["estimate"]) == {
        "policy_gpu",
        "reference_gpu",
        "activations_gpu",
        "context_parallel_gpu",
        "vision_gpu",
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
        (["34B", "--zero-stage", "2", "--reference", "offload"], "--zero-stage 3 or --fsdp2"),
        (["34B", "--fsdp2", "--zero-stage", "3"], "--fsdp2 and --zero-stage 3 are exclusive"),
        (["34B", "--fsdp2", "--zero-stage", "0"], "Drop --zero-stage"),
        (["34B", "--fsdp2", "--offload-optimizer"], "under --fsdp2 use --fsdp2-offload-params"),
        (["34B", "--fsdp2", "--offload-param", "--offload-optimizer"], "under --fsdp2 use --fsdp2-offload-params"),
        (["34B", "--fsdp2-offload-params"], "--fsdp2-offload-params needs --fsdp2"),
        (["34B", "--context-parallel", "0"], "--context-parallel must be at least 1"),
        (["34B", "--context-parallel", "3"], "--context-parallel 3 must divide the number of GPUs, 8"),
        (["34B", "--fsdp2", "--gpus-per-node", "4", "--context-parallel", "8"], "must divide the number of GPUs, 4"),
        (["34B", "--context-parallel", "two"], "--context-parallel"),
        (["34B", "--fsdp2"], "instead of a parameter count"),  # FSDP2 needs the decoder layers' size
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


# A vision-language model's row: each GPU that shares it encodes its share of the row's images (or, not dealt, all)

QWEN2_5_VL_7B = dict(
    model_type="qwen2_5_vl",
    text_config=dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]),
    ),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
)  # fmt: skip


def test_a_vision_language_row_counts_each_gpus_share_of_the_vision_tower(tmp_path):
    from transformers import AutoConfig

    values = dict(QWEN2_5_VL_7B)
    AutoConfig.for_model(values.pop("model_type"), **values).save_pretrained(tmp_path)
    shape = load_model_shape(str(tmp_path))
    assert (shape.vision_layers, shape.vision_hidden_size, shape.vision_patches_per_token) == (32, 1280, 4)
    assert 8.2e9 < shape.total_params < 8.4e9  # the language model and the vision tower (Qwen2.5-VL-7B: 8.29B)
    text_only = estimate(shape, Setup(tokens=65536, context_parallel_size=8))
    whole = estimate(shape, Setup(tokens=65536, context_parallel_size=8, image_tokens=40000, deal_images=False))
    # 160000 patches (2 x 2 per image token), each GPU all of them: checkpointed inputs, one block recomputed
    patches, b, h = 160000, 2, 1280
    assert whole.vision_gpu > 32 * b * h * patches  # 13 GiB of block inputs alone
    assert whole.activations_gpu == text_only.activations_gpu + whole.vision_gpu
    assert estimate(shape, Setup(tokens=65536, image_tokens=40000)).vision_gpu == whole.vision_gpu  # one GPU: all
    # Dealt (the default): each of the 8 GPUs encodes 5000 of the image tokens, 1/8 of the tower's activations
    dealt = estimate(shape, Setup(tokens=65536, context_parallel_size=8, image_tokens=40000))
    assert dealt.vision_gpu == estimate(shape, Setup(tokens=65536, image_tokens=5000)).vision_gpu
    assert dealt.vision_gpu == pytest.approx(whole.vision_gpu / 8, rel=1e-6)
    assert estimate(shape, Setup(tokens=65536)).vision_gpu == 0


def test_the_report_names_the_vision_tower(tmp_path, capsys):
    from transformers import AutoConfig

    values = dict(QWEN2_5_VL_7B)
    AutoConfig.for_model(values.pop("model_type"), **values).save_pretrained(tmp_path)
    assert (
        main(["plan", str(tmp_path), "--tokens", "65536", "--context-parallel", "8", "--image-tokens", "40000"]) == 0
    )
    assert "of which the vision tower, its share of the row's images: 5000 of 40000 image tokens" in (
        capsys.readouterr().out
    )
    arguments = ["plan", str(tmp_path), "--tokens", "65536", "--context-parallel", "8", "--image-tokens", "40000"]
    assert main([*arguments, "--whole-images"]) == 0
    assert "of which the vision tower, all 40000 image tokens of the row" in capsys.readouterr().out
