"""Every shipped accelerate config parses and builds an `Accelerator`, the way `accelerate launch` builds it.

For each YAML, accelerate's own `launch_command` reads it and picks the launcher (`--num_processes 1` is the only
flag added); the launcher itself is swapped for a recorder. The environment the training script would get comes from
the `accelerate.utils.launch.prepare_*` function that launcher calls, plus the variables torchrun sets for a world of
one process. A probe script then builds `Accelerator()` under that environment in a fresh process (accelerate's
state is a process-wide singleton), and the result is checked against the YAML: distributed type, for DeepSpeed
the ZeRO stage, offload devices, zero.Init and the bf16 setting, and for FSDP every fsdp_config entry.

On a machine without CUDA three things change, each what a CPU run of the same launch needs: DeepSpeed gets its CPU
accelerator (gloo), the multi-GPU config gets `ACCELERATE_USE_CPU`, so data parallelism builds as MULTI_CPU, and the
FSDP configs run the probe through tests/support/distributed/fsdp_on_cpu.py, so FSDP builds over gloo. Not
`accelerate launch --cpu`: that sends every config to the simple launcher and silently drops DeepSpeed. Not
`accelerate launch` itself either: 7-11 s per config on 2 cores (its imports, torchrun's agent) against ~15 s here for
all of them.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.commands import launch as accelerate_launch
from accelerate.utils.launch import (
    prepare_deepspeed_cmd_env,
    prepare_multi_gpu_env,
    prepare_simple_launcher_cmd_env,
)
from distributed_runs import free_port, script_command

from trl_padfree.cli.launch import shipped_configs

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = list(shipped_configs("accelerate_configs").values())
DEEPSPEED_INSTALLED = importlib.util.find_spec("deepspeed") is not None

PROBE = """\
import json
from accelerate import Accelerator

accelerator = Accelerator()
state = accelerator.state
report = {
    "distributed_type": state.distributed_type.name,
    "num_processes": accelerator.num_processes,
    "mixed_precision": accelerator.mixed_precision,
}
if state.deepspeed_plugin is not None:
    report["zero_stage"] = state.deepspeed_plugin.zero_stage
    report["zero3_init_flag"] = state.deepspeed_plugin.zero3_init_flag
    report["deepspeed_config"] = state.deepspeed_plugin.deepspeed_config
if getattr(state, "fsdp_plugin", None) is not None:
    plugin = state.fsdp_plugin
    report["fsdp"] = {
        "version": plugin.fsdp_version,
        "offload_params": type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy",
        "reshard_after_forward": plugin.reshard_after_forward,
        "auto_wrap_policy": getattr(plugin.auto_wrap_policy, "__name__", None),
        "cpu_ram_efficient_loading": plugin.cpu_ram_efficient_loading,
        "state_dict_type": plugin.state_dict_type.name,
        "activation_checkpointing": plugin.activation_checkpointing,
    }
if accelerator.parallelism_config is not None:
    config = accelerator.parallelism_config
    report["parallelism_config"] = {"sp_size": config.sp_size, "sp_backend": config.sp_backend}
print("ACCELERATOR " + json.dumps(report))
"""


def header(config: Path) -> list[str]:
    """The comment lines before the first setting."""
    lines = config.read_text().splitlines()
    return lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_header_gives_the_command_that_uses_it(config):
    command = " ".join(line.lstrip("# ").rstrip("\\") for line in header(config))
    assert f"trl-padfree dpo --accelerate_config {config.stem} --config " in command


def test_no_two_configs_differ_by_comments_only():
    # One knob per decision: a config that only repeats another (offloading the reference is the DPO config's
    # `ref_offload`, which no accelerate config can carry) would look like a choice and be none
    settings = {config.name: yaml.safe_load(config.read_text()) for config in CONFIGS}
    names = sorted(settings)
    same = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if settings[a] == settings[b]]
    assert not same, same


@pytest.mark.parametrize("name", ["zero3.yaml", "fsdp2.yaml"])
def test_sharded_configs_say_how_to_offload_the_reference(name):
    text = " ".join(line.lstrip("# ") for line in header(shipped_configs("accelerate_configs")[name[:-5]]))
    assert "Reference offload: set `ref_offload: true` in the DPO config" in text


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_deepspeed_and_fsdp_keys_are_launch_options(config):
    # accelerate rejects unknown top-level keys, but copies deepspeed_config and fsdp_config entries onto the launch
    # arguments by name and silently ignores the ones no option reads (a misspelt offload device would train without
    # offload)
    options = {action.dest for action in accelerate_launch.launch_command_parser()._actions}
    settings = yaml.safe_load(config.read_text())
    unknown = {*settings.get("deepspeed_config", {}), *settings.get("fsdp_config", {})} - options
    assert not unknown, f"{config.name}: not `accelerate launch` options, ignored: {sorted(unknown)}"


def launch_environment(config: Path, probe: Path) -> tuple[list[str], dict[str, str]]:
    """The command and environment `accelerate launch --config_file CONFIG --num_processes 1 PROBE` gives PROBE."""
    chosen = {}
    argv = ["--config_file", str(config), "--num_processes", "1", "--main_process_port", str(free_port()), str(probe)]
    with pytest.MonkeyPatch.context() as patch:
        for launcher in ("simple_launcher", "multi_gpu_launcher", "deepspeed_launcher"):
            patch.setattr(
                accelerate_launch,
                launcher,
                lambda args, launcher=launcher: chosen.update(launcher=launcher, args=args),
            )
        accelerate_launch.launch_command(accelerate_launch.launch_command_parser().parse_args(argv))
    launcher, args = chosen["launcher"], chosen["args"]
    if launcher == "simple_launcher":  # runs the script as is
        return prepare_simple_launcher_cmd_env(args)
    script = [args.training_script]
    if launcher == "multi_gpu_launcher":
        environment = prepare_multi_gpu_env(args)
        if not torch.cuda.is_available():
            script = script_command(config, Path(args.training_script))  # FSDP: through fsdp_on_cpu.py
            if len(script) == 1:
                environment["ACCELERATE_USE_CPU"] = "true"  # gloo data parallelism instead of NCCL
    else:
        assert launcher == "deepspeed_launcher", launcher
        _, environment = prepare_deepspeed_cmd_env(args)
        if not torch.cuda.is_available():
            environment["DS_ACCELERATOR"] = "cpu"  # DeepSpeed would guess it, with a warning
    # the two launchers above hand the script to torchrun, which sets these for each process
    world_of_one = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    world_of_one |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.main_process_port)}
    return [sys.executable, *script, *args.training_script_args], environment | world_of_one


@pytest.fixture(scope="module")
def accelerators(tmp_path_factory) -> dict[str, dict]:
    """What `Accelerator()` reports under each config (or why it did not build), all probes run at once: each spends
    seconds importing."""
    probe = tmp_path_factory.mktemp("probe") / "probe.py"
    probe.write_text(PROBE)
    reports, runs = {}, {}
    try:
        for config in CONFIGS:
            if yaml.safe_load(config.read_text())["distributed_type"] == "DEEPSPEED" and not DEEPSPEED_INSTALLED:
                continue  # the test skips it
            try:
                command, environment = launch_environment(config, probe)
            except Exception as error:  # reported by this config's test, not as an error of every test
                reports[config.name] = {"failed": f"accelerate launch refused it: {error!r}"}
                continue
            runs[config.name] = subprocess.Popen(
                command, env=environment, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        for name, run in runs.items():
            try:  # generous: on a fresh machine DeepSpeed first compiles its CPU shared-memory comm op (20-120 s)
                output = run.communicate(timeout=600)[0]
            except subprocess.TimeoutExpired:
                run.kill()
                output = run.communicate()[0] + "\n(killed after 600 s)"
            lines = [line for line in output.splitlines() if line.startswith("ACCELERATOR ")]
            reports[name] = json.loads(lines[0].removeprefix("ACCELERATOR ")) if lines else {"failed": output[-3000:]}
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
    return reports


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_config_builds_an_accelerator(config, accelerators):
    settings = yaml.safe_load(config.read_text())
    if settings["distributed_type"] == "DEEPSPEED":
        pytest.importorskip("deepspeed")
    report = accelerators[config.name]
    assert "failed" not in report, report.get("failed")

    expected_type = settings["distributed_type"]
    if expected_type == "MULTI_GPU" and not torch.cuda.is_available():
        expected_type = "MULTI_CPU"
    assert report["distributed_type"] == expected_type
    assert report["num_processes"] == 1
    assert report["mixed_precision"] == settings["mixed_precision"]
    if parallelism := settings.get("parallelism_config"):  # sequence parallelism, passed on as environment variables
        assert report["parallelism_config"] == {
            "sp_size": parallelism["parallelism_config_sp_size"],
            "sp_backend": parallelism["parallelism_config_sp_backend"],
        }
    else:
        assert "parallelism_config" not in report
    if expected_type == "FSDP":
        assert_fsdp_as_configured(report["fsdp"], settings["fsdp_config"])
    if expected_type != "DEEPSPEED":
        return

    deepspeed_settings = settings["deepspeed_config"]
    zero = report["deepspeed_config"]["zero_optimization"]
    assert report["zero_stage"] == zero["stage"] == deepspeed_settings["zero_stage"]
    assert zero["offload_param"]["device"] == deepspeed_settings["offload_param_device"]
    assert zero["offload_optimizer"]["device"] == deepspeed_settings["offload_optimizer_device"]
    if zero["stage"] < 3:
        assert zero["offload_param"]["device"] == "none", "parameter offload exists only at ZeRO stage 3"
    # accelerate drops zero.Init below stage 3 with a warning; equal means the YAML asked for what it gets
    assert report["zero3_init_flag"] == deepspeed_settings["zero3_init_flag"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] == deepspeed_settings.get("zero3_save_16bit_model", False)
    # DeepSpeed, not autocast, runs mixed precision: accelerate writes the YAML's choice into the DeepSpeed config
    assert report["deepspeed_config"]["bf16"]["enabled"] == (settings["mixed_precision"] == "bf16")


def assert_fsdp_as_configured(fsdp: dict, settings: dict) -> None:
    # accelerate copies fsdp_config entries onto launch options by name, like deepspeed_config's: a misspelt one is
    # silently ignored, so each must come back as set
    assert fsdp["version"] == settings["fsdp_version"] == 2
    assert fsdp["offload_params"] == settings["fsdp_offload_params"]
    assert fsdp["reshard_after_forward"] == settings["fsdp_reshard_after_forward"]
    wrap_policies = {
        "TRANSFORMER_BASED_WRAP": "transformer_auto_wrap_policy",
        "SIZE_BASED_WRAP": "size_based_auto_wrap_policy",
    }
    assert fsdp["auto_wrap_policy"] == wrap_policies[settings["fsdp_auto_wrap_policy"]]
    assert fsdp["cpu_ram_efficient_loading"] == settings["fsdp_cpu_ram_efficient_loading"]
    assert fsdp["state_dict_type"] == settings["fsdp_state_dict_type"]
    assert fsdp["activation_checkpointing"] == settings["fsdp_activation_checkpointing"]
