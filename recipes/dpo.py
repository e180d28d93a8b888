"""Padding-free DPO, in the shape of TRL's DPO script: script, training and model arguments from the command line or
from `--config file.yaml`.

    python recipes/dpo.py --config recipes/configs/tiny_cpu.yaml
    ACCELERATE_USE_CPU=true accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml \\
        --num_processes 2 recipes/dpo.py --config recipes/configs/tiny_cpu.yaml
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \\
        recipes/dpo.py --config recipes/configs/qwen2.5-0.5b_1gpu.yaml

Every `trl_padfree.DPOConfig` field is a flag or a YAML key: all of TRL's, plus the fields trl-padfree adds
(listed in `DPOConfig`'s docstring: `packed_attn_implementation`, `prefix_sharing`, `max_tokens_per_batch`,
`ref_offload`, `sequence_parallel_size`, `context_parallel_size`, ...).
Besides hub names and local paths, `model_name_or_path` takes a demo model built locally from a config
(`trl-padfree/<tiny|small|base>-<llama|qwen2|...>`), and `dataset_name` takes the data shipped in the package
(`trl-padfree/demo-preferences`) or a local .jsonl/.json/.parquet/.csv file.
"""

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from trl_padfree import DPOConfig, DPOTrainer
from trl_padfree.cli import exit_without_finalizing, one_line_errors, one_line_usage_errors
from trl_padfree.sources import load_preference_dataset, resolve_model


def main(script_args: ScriptArguments, training_args: DPOConfig, model_args: ModelConfig) -> int:
    """Train and save; returns the number of processes the run used."""
    if script_args.dataset_name is None:
        raise ValueError("Set `dataset_name` (a hub dataset, a local file, or trl-padfree/demo-preferences).")
    # The policy and the reference model are both loaded from these, as in TRL's script
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    dataset = load_preference_dataset(script_args.dataset_name, script_args.dataset_config)
    evaluate = training_args.eval_strategy != "no"
    for split in [script_args.dataset_train_split] + ([script_args.dataset_test_split] if evaluate else []):
        if split not in dataset:
            raise ValueError(f"Dataset {script_args.dataset_name!r} has no split {split!r}; it has {list(dataset)}.")

    trainer = DPOTrainer(
        model=resolve_model(model_args.model_name_or_path),
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if evaluate else None,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}")
    trainer.end()
    return trainer.accelerator.num_processes


if __name__ == "__main__":
    with one_line_errors("recipes/dpo.py"):
        parser = one_line_usage_errors(TrlParser((ScriptArguments, DPOConfig, ModelConfig)))
        processes = main(*parser.parse_args_and_config())
    if processes > 1:
        # torch's gloo workers may still be releasing the last collectives: see exit_without_finalizing
        exit_without_finalizing()
