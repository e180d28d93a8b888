"""The shipped recipe configs: each parses into the training script's arguments and starts with the command that runs
it; each that names its GPUs fits them by the memory planner's own estimate, under the accelerate config its command
names; TRL's own script runs with the swapped import; bad input to the training script is a one-line error.
`trl-padfree dpo` itself (the launch, the wheel, mixtures, push_to_hub): tests/integration/dpo_command/test_dpo_command.py."""

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from one_line_errors import assert_one_line_error
from transformers import AutoConfig, LlamaConfig, Qwen2Config

from trl_padfree.cli import dpo
from trl_padfree.cli.dpo import make_parser
from trl_padfree.cli.launch import shipped_configs
from trl_padfree.data import DATA_DIR
from trl_padfree.plan import GiB, Setup, estimate, parse_memory, shape_of_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = shipped_configs("configs")
ACCELERATE_CONFIGS = shipped_configs("accelerate_configs")
# The tiny config, made a few seconds long: the smallest model, two steps, no evaluation
QUICK = ["--model_name_or_path", "trl-padfree/tiny-llama", "--max_steps", "2", "--logging_steps", "1"]


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    import os

    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "TRL_PADFREE_CACHE": str(cache), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}


def run(command: list[str], environment: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=environment, cwd=cwd, timeout=600)


def header_commands(config: Path) -> list[list[str]]:
    """Each `trl-padfree dpo` command of a config's header (the comments before its first setting), as the arguments
    after `dpo`, continuation lines joined."""
    lines = config.read_text().splitlines()
    joined = " ".join(
        line.lstrip("# ") for line in lines[: next(i for i, line in enumerate(lines) if line[:1] != "#")]
    )
    commands = joined.replace("\\ ", "").split("trl-padfree dpo ")[1:]
    # a command ends at the first word that is neither an option nor an option's value
    return [re.match(r"((?:--\S+(?: [^-\s(]\S*)? ?)+)", command).group(1).split() for command in commands]


def launch_command(name: str) -> list[str]:
    """The arguments after `dpo` of the first command in the recipe's header, which must run this recipe."""
    commands = header_commands(RECIPES[name])
    assert commands and commands[0][:2] == ["--config", name], f"{name}.yaml: its header gives no command to run it"
    return commands[0]


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_config_parses(name):
    assert RECIPES[name].read_text().startswith("#"), "each config starts with a comment saying what it runs"
    launch_command(name)
    # GPU configs ask for bf16, which the parser refuses on a CPU-only machine
    script_args, training_args, model_args, _ = make_parser().parse_args_and_config(
        ["--config", str(RECIPES[name]), "--use_cpu", "true", "--bf16", "false"]
    )
    assert training_args.padding_free and script_args.dataset_name and model_args.model_name_or_path


# ---------------------------------------------------------------------------------------------------------------------
# Every recipe that names its GPUs fits them, by the planner's estimate. The hub models' config.json fields that set
# their size, written here so nothing is downloaded

LLAMA_3_1_8B = LlamaConfig(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=False,
)  # fmt: skip
QWEN2_5_7B = Qwen2Config(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False,
)  # fmt: skip
HUB_CONFIGS = {
    "meta-llama/Llama-3.1-8B-Instruct": lambda: LLAMA_3_1_8B,
    "Qwen/Qwen2.5-7B-Instruct": lambda: QWEN2_5_7B,
    "Qwen/Qwen2.5-0.5B-Instruct": lambda: Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
    ),
    "01-ai/Yi-1.5-34B-Chat": lambda: LlamaConfig(
        hidden_size=7168, intermediate_size=20480, num_hidden_layers=60, num_attention_heads=56, num_key_value_heads=8,
        vocab_size=64000, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-VL-7B-Instruct": lambda: AutoConfig.for_model(
        "qwen2_5_vl",
        text_config=dict(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, vocab_size=152064,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]),
        ),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
    ),
}  # fmt: skip
# What the planner does not model, so no figure can be claimed for it
NOT_PLANNED = {"llama3.1-8b_lora_1gpu": "LoRA (the planner counts full-parameter training)"}


def named_gpus(name: str) -> tuple[int, int] | None:
    """(GPU count, bytes per GPU) from the header's first sentence, "8 x 80 GB GPUs" or "one 24 GB GPU"; None on CPU."""
    lines = RECIPES[name].read_text().splitlines()
    first_sentence = " ".join(line.lstrip("# ") for line in lines[:3]).split(".\n")[0].split(". ")[0]
    match = re.search(r"(\d+ x|one) (\d+) GB GPU", first_sentence)
    if match is None:
        return None
    count = 1 if match.group(1) == "one" else int(match.group(1).split()[0])
    return count, parse_memory(f"{match.group(2)}GB")  # strict: 80 GB is 74.5 GiB, below the planner's default


def planned_setup(name: str) -> Setup:
    """The planner's setup for a recipe under the accelerate config its command names: every field from the two
    configs. A row holds at most pairs x 2 x max_length tokens, or max_tokens_per_batch; under Ulysses each GPU of a group runs 1/sp of them
    (docs/concepts/memory-planning.md); a vision-language row is counted as if all its tokens were image tokens."""
    command = launch_command(name)
    recipe = yaml.safe_load(RECIPES[name].read_text())
    accelerate = yaml.safe_load(ACCELERATE_CONFIGS[command[command.index("--accelerate_config") + 1]].read_text())
    gpus, gpu_memory = named_gpus(name)
    assert accelerate["num_processes"] == gpus, f"{name}: the accelerate config launches another GPU count"
    engine = accelerate["distributed_type"]
    deepspeed = accelerate.get("deepspeed_config", {})
    sp_size = recipe.get("sequence_parallel_size") or accelerate.get("parallelism_config", {}).get(
        "parallelism_config_sp_size", 1
    )
    # A token budget bounds a row (under dynamic context parallelism: the widest row, over every GPU of the group)
    tokens = recipe.get("max_tokens_per_batch") or recipe["per_device_train_batch_size"] * 2 * recipe["max_length"]
    tokens //= sp_size
    vision_language = "vision_config" in HUB_CONFIGS[recipe["model_name_or_path"]]().to_dict()
    reference = "offload" if recipe.get("ref_offload") else "gpu"
    return Setup(
        gpus_per_node=gpus,
        gpu_memory=gpu_memory,
        zero_stage=deepspeed["zero_stage"] if engine == "DEEPSPEED" else (None if engine == "FSDP" else 0),
        offload_optimizer=deepspeed.get("offload_optimizer_device") == "cpu",
        offload_param=deepspeed.get("offload_param_device") == "cpu",
        zero_init=deepspeed.get("zero3_init_flag", True),
        fsdp2=engine == "FSDP",
        fsdp_offload_params=accelerate.get("fsdp_config", {}).get("fsdp_offload_params", False),
        precision="bf16" if recipe.get("bf16") else "fp32",
        reference="precompute" if recipe.get("precompute_ref_log_probs") else reference,
        tokens=tokens,
        context_parallel_size=recipe.get("context_parallel_size", 1),
        image_tokens=tokens if vision_language else 0,
        activation_checkpointing=recipe.get("activation_checkpointing", False),
    )


GPU_RECIPES = [name for name in RECIPES if named_gpus(name) is not None]


def test_every_recipe_but_the_cpu_one_names_its_gpus():
    assert set(RECIPES) - set(GPU_RECIPES) == {"tiny_cpu"}


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_recipe_fits_the_gpus_it_names_by_the_planners_estimate(name):
    pytest.importorskip("deepspeed")  # ZeRO's estimates are DeepSpeed's own estimators
    if name in NOT_PLANNED:
        pytest.skip(f"not planned: {NOT_PLANNED[name]}")
    model = yaml.safe_load(RECIPES[name].read_text())["model_name_or_path"]
    setup = planned_setup(name)
    result = estimate(shape_of_config(model, HUB_CONFIGS[model]()), setup)
    assert result.fits, f"{name}: {result.gpu_total / GiB:.1f} GiB per GPU of {setup.gpu_memory / GiB:.1f}"


# ---------------------------------------------------------------------------------------------------------------------
# TRL's own script, swapped


def test_trl_script_with_swapped_import_trains_padding_free(tmp_path, environment):
    script = tmp_path / "dpo_swapped.py"
    swap = run([sys.executable, str(ROOT / "recipes" / "trl_script_swap_in.py"), str(script)], environment)
    assert swap.returncode == 0, swap.stderr
    changed = [line for line in swap.stdout.splitlines() if line.startswith(("+", "-")) and line[:3] not in "+++---"]
    assert changed == [
        "+    from trl_padfree import DPOTrainer  # swap-in: padding-free DPO",
        "+    from trl_padfree import DPOConfig  # swap-in: padding-free DPO",
    ]
    # TRL's script loads datasets by name: a folder with train/test files is one
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text((DATA_DIR / f"preferences_{split}.jsonl").read_text())
    environment = {**environment, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(script), "--dataset_name", str(data), "--output_dir", str(tmp_path / "out")]
    command += ["--model_name_or_path", _tiny_model_path(environment), "--padding_free", "true"]
    command += "--max_steps 2 --logging_steps 1 --use_cpu true --bf16 false --report_to none".split()
    result = run(command, environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "padfree/padding_removed" in result.stdout  # the swapped trainer ran, packed


def _tiny_model_path(environment: dict) -> str:
    code = "from trl_padfree.sources import resolve_model; print(resolve_model('trl-padfree/tiny-llama'))"
    # the last line: importing DeepSpeed may log to stdout first
    return run([sys.executable, "-c", code], environment).stdout.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------------------------------
# Bad input to the training script (what each process runs), in this process: a fresh one costs seconds


def run_training_script_in_process(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """Exit status and stderr of `python -m trl_padfree.cli.dpo ARGS`."""
    monkeypatch.setattr(sys, "argv", [dpo.__file__, *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(dpo.__file__, run_name="__main__")
    return exit_info.value.code, capsys.readouterr().err


def test_unknown_config_key_is_one_line_error(tmp_path, monkeypatch, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(RECIPES["tiny_cpu"].read_text() + "\nlearning_rat: 1.0e-5\n")
    args = ["--config", str(config), "--output_dir", str(tmp_path)]
    assert_one_line_error(*run_training_script_in_process(args, monkeypatch, capsys), "learning_rat")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--dataset_name", "/no/such/pairs.jsonl"], "/no/such/pairs.jsonl"),
        (["--dataset_name", "./no_such_folder"], "no_such_folder"),
        (["--model_name_or_path", "trl-padfree/huge-llama"], "huge-llama"),
        (["--model_name_or_path", "/no/such/model"], "Model folder '/no/such/model' does not exist"),
        (["--dataset_train_split", "validation"], "validation"),
        (["--learning_rate", "fast"], "--learning_rate"),
        (["--num_procesess", "2"], "--num_procesess"),
        (["--config", "no_such_recipe"], "no shipped config of that name"),
    ],
)
def test_bad_input_to_the_training_script_is_one_line_error(
    args, expected, tmp_path, monkeypatch, capsys, environment
):
    for name in ("TRL_PADFREE_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, environment[name])
    script_args = ["--config", "tiny_cpu", *QUICK, "--output_dir", str(tmp_path), *args]
    assert_one_line_error(*run_training_script_in_process(script_args, monkeypatch, capsys), expected)
