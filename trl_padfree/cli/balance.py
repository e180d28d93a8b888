"""`trl-padfree balance`: how long the slowest data-parallel process makes each step, dealt as usual or balanced.

A simulation to run before a big job, no model and no GPU: for each number of processes and pairs per process, draw
`--steps` optimizer steps of pairs, cost every pair with the FLOP model (`packing.balance.pair_cost`), and compare
the expected slowest row over the mean row (`packing.balance.imbalance`) of

- the default sampler: each process takes `pairs_per_process` consecutive pairs of the shuffled data, as accelerate
  deals TRL's batches out, and
- `packing.balance.best_split`: the same pairs, split by cost as the trainer splits them (LPT per micro-step);

and their ratio, the step-time gain balancing would bring if a step's time is its slowest row's FLOPs.

Pairs come from the bench's length models (`--distribution`, drawn as `trl-padfree bench` draws them: a pool of
`POOL_PAIRS` pairs per distribution, then each step's pairs drawn from the pool) or from a dataset (`--dataset`), its
pairs truncated to `--max-length` as TRL truncates them. See docs/concepts/balancing.md.

`--context-parallel C` simulates context-parallel groups instead: every row split over C ranks against rows on the
ranks their length needs (`context_parallel_balance`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from datasets import DatasetDict, load_from_disk
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..costs.flops import DecoderShape
from ..data import load_demo_tokenizer
from ..data.length_models import MULTI_TURN, REASONING, SINGLE_TURN
from ..packing.balance import best_split, bin_costs, imbalance, pair_cost, row_cost_lower_bound
from ..packing.layout import kept_prompt_and_completion
from ..packing.prefix_sharing import DEFAULT_MIN_PROMPT_TOKENS, shared_prefix_length
from ..sources import load_preference_dataset
from . import context_parallel_balance
from .bench.harness import MODEL_SHAPES, decoder_shape, markdown_table, sample_lengths, truncated_pair_lengths

LENGTH_MODELS = {"ultrafeedback": SINGLE_TURN, "capybara": MULTI_TURN, "reasoning": REASONING}
SHIPPED_DISTRIBUTIONS = ["ultrafeedback", "capybara"]  # without --context-parallel
# The cost model: an 8B Llama (Llama 3.1 8B's config, one of the bench's shapes)
DEFAULT_MODEL = "llama3.1-8b"
# Pairs drawn once per distribution; every simulated step then draws its pairs from them. 2^17 pairs keep the pool's
# lengths within sampling noise of the length model while the pool takes about a second to draw and cost
POOL_PAIRS = 2**17
TOKENIZED_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
TEXT_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class BalanceRow:
    """One setting's simulated steps: the expected `imbalance` (slowest row over mean row, summed over micro-steps)
    with the pairs dealt as usual and balanced, and `lower_bound`, what no split of the same pairs can beat: the
    larger of the mean row and `row_cost_lower_bound` over the mean row (with several micro-steps a loose bound)."""

    distribution: str
    pairs_per_process: int
    processes: int
    micro_steps: int
    steps: int
    unbalanced: float
    balanced: float
    lower_bound: float

    @property
    def step_time_gain(self) -> float:
        """How much shorter a step is balanced, if its time is its slowest rows' FLOPs."""
        return self.unbalanced / self.balanced

    def to_json(self) -> dict:
        return {**asdict(self), "step_time_gain": self.step_time_gain}


# ---------------------------------------------------------------------------------------------------------------------
# Model and pairs


def load_decoder_shape(model_config: str) -> DecoderShape:
    """The FLOP model's shape of `model_config`: a bench shape name (`MODEL_SHAPES`), or a local
    config.json or model folder. Its layers' parameters are counted on the meta device (no memory), so hybrids and
    mixtures of experts count right too (`bench.harness.decoder_shape`)."""
    if model_config in MODEL_SHAPES:
        values = dict(MODEL_SHAPES[model_config])
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    elif Path(model_config).exists():
        config = AutoConfig.from_pretrained(model_config)
    else:
        raise FileNotFoundError(
            f"--model-config {model_config!r} is neither a config.json or model folder nor one of {sorted(MODEL_SHAPES)}."
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return decoder_shape(model)


def sampled_pairs(distribution: str, count: int, max_length: int, seed: int) -> list[tuple[int, int, int]]:
    """`count` truncated (prompt, chosen, rejected) token counts from a shipped length model, drawn as
    `trl-padfree bench --distributions` draws them (the same pairs for the same seed)."""
    rng = random.Random(seed)
    model = LENGTH_MODELS[distribution]
    return [truncated_pair_lengths(*sample_lengths(model, rng, max_length), max_length) for _ in range(count)]


def dataset_pairs(path: str, tokenizer_path: str | None, max_length: int, split: str) -> list[tuple[int, int, int]]:
    """Truncated (prompt, chosen, rejected) token counts of a local dataset's pairs, as TRL tokenizes and truncates
    them (keep_start): pre-tokenized `prompt_ids`/`chosen_ids`/`rejected_ids` as they are, or string
    `prompt`/`chosen`/`rejected` columns tokenized with an EOS appended to each completion. Pairs whose prompt fills
    `max_length` are dropped, as TRL drops them."""
    dataset = _load_split(path, split)
    if set(TOKENIZED_COLUMNS) <= set(dataset.column_names):
        lengths = [[len(ids) for ids in dataset[column]] for column in TOKENIZED_COLUMNS]
    elif set(TEXT_COLUMNS) <= set(dataset.column_names):
        lengths = _tokenized_lengths(dataset, tokenizer_path)
    else:
        raise ValueError(
            f"--dataset {path}: columns {dataset.column_names}; need {list(TEXT_COLUMNS)} (strings) or "
            f"{list(TOKENIZED_COLUMNS)}."
        )
    pairs = []
    for prompt, chosen, rejected in zip(*lengths, strict=True):
        if prompt >= max_length:
            continue
        kept = [kept_prompt_and_completion(prompt, completion, max_length)[1] for completion in (chosen, rejected)]
        pairs.append((prompt, *kept))
    if not pairs:
        raise ValueError(f"--dataset {path}: no pair has a prompt shorter than --max-length {max_length}.")
    return pairs


def _load_split(path: str, split: str):
    folder = Path(path)
    saved = folder.is_dir() and any((folder / name).exists() for name in ("dataset_dict.json", "state.json"))
    dataset = load_from_disk(str(folder)) if saved else load_preference_dataset(path)
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise ValueError(f"--dataset {path} has splits {sorted(dataset)}; pick one with --split.")
        dataset = dataset[split]
    return dataset


def _tokenized_lengths(dataset, tokenizer_path: str | None) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else load_demo_tokenizer()
    if not all(isinstance(dataset[0][column], str) for column in TEXT_COLUMNS):
        raise ValueError(
            "--dataset: prompt/chosen/rejected must be strings (conversational data: pre-tokenize it into "
            f"{list(TOKENIZED_COLUMNS)} as TRL does)."
        )
    eos = tokenizer.eos_token or ""
    lengths = []
    for column in TEXT_COLUMNS:
        texts = list(dataset[column])
        if column != "prompt":  # TRL appends the EOS to completions that lack it
            texts = [text if text.endswith(eos) else text + eos for text in texts]
        lengths.append([len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]])
    return lengths


def pool_costs(pairs: list[tuple[int, int, int]], shape: DecoderShape, prefix_sharing: bool = False) -> np.ndarray:
    """Each pair's training-step FLOPs in a packed row (`pair_cost`), shared as `prefix_sharing=True` would lay it
    out when `prefix_sharing`."""
    costs = np.empty(len(pairs))
    for number, (prompt, chosen, rejected) in enumerate(pairs):
        shared = shared_prefix_length(prompt, prompt, DEFAULT_MIN_PROMPT_TOKENS) if prefix_sharing else 0
        costs[number] = pair_cost(shape, prompt + chosen, prompt + rejected, chosen + rejected, shared)
    return costs


# ---------------------------------------------------------------------------------------------------------------------
# Simulation


def simulate(
    costs: np.ndarray, processes: int, pairs_per_process: int, micro_steps: int, steps: int, seed: int
) -> tuple[float, float, float]:
    """Mean over `steps` optimizer steps of the imbalance dealt as usual, balanced, and its lower bound.

    Each step draws `processes x pairs_per_process x micro_steps` pairs of `costs` at random (without replacement
    when the pool holds that many): a shuffled sampler's global batch. Dealt as usual, process p's row at micro-step
    t holds the pairs at positions [(t x processes + p) x pairs_per_process, ... + pairs_per_process).
    """
    rng = np.random.default_rng([seed, processes, pairs_per_process, micro_steps])
    global_batch = processes * pairs_per_process * micro_steps
    unbalanced, balanced, bound = [], [], []
    for _ in range(steps):
        drawn = costs[rng.choice(len(costs), size=global_batch, replace=global_batch > len(costs))]
        dealt = drawn.reshape(micro_steps, processes, pairs_per_process).sum(axis=2)
        unbalanced.append(imbalance(dealt.tolist()))
        step_costs = drawn.tolist()
        rows = np.arange(global_batch).reshape(micro_steps, processes, pairs_per_process).tolist()
        split = best_split(step_costs, processes, micro_steps, dealt=rows)
        balanced.append(imbalance(bin_costs(step_costs, split)))
        # No split beats the mean row, nor the row some pairs must share (the step waits for it at least)
        row_bound = row_cost_lower_bound(step_costs, processes * micro_steps)
        bound.append(max(1.0, row_bound * processes / sum(step_costs)))
    return float(np.mean(unbalanced)), float(np.mean(balanced)), float(np.mean(bound))


def run_context_parallel(options: argparse.Namespace) -> int:
    shape = load_decoder_shape(options.model_config)
    if options.dataset:

        def picked(count: int, max_length: int) -> list[tuple[int, int, int]]:
            pairs = dataset_pairs(options.dataset, options.tokenizer, max_length, options.split)
            rng = random.Random(options.seed)
            return [pairs[rng.randrange(len(pairs))] for _ in range(count)]

        sources = {Path(options.dataset).name: picked}
    else:
        sources = {
            name: lambda count, max_length, name=name: sampled_pairs(name, count, max_length, options.seed)
            for name in options.distribution
        }
    return context_parallel_balance.run(options, shape, sources)


def run_balance(options: argparse.Namespace) -> list[BalanceRow]:
    """One row per source, pairs per process and process count."""
    shape = load_decoder_shape(options.model_config)
    if options.dataset:
        pairs = dataset_pairs(options.dataset, options.tokenizer, options.max_length, options.split)
        sources = {Path(options.dataset).name: pairs}
    else:
        sources = {
            name: sampled_pairs(name, POOL_PAIRS, options.max_length, options.seed) for name in options.distribution
        }
    rows = []
    for name, pairs in sources.items():
        costs = pool_costs(pairs, shape, options.prefix_sharing)
        for pairs_per_process in options.pairs_per_process:
            for processes in options.processes:
                results = simulate(
                    costs, processes, pairs_per_process, options.micro_steps, options.steps, options.seed
                )
                rows.append(
                    BalanceRow(name, pairs_per_process, processes, options.micro_steps, options.steps, *results)
                )
    return rows


def format_table(rows: list[BalanceRow]) -> str:
    columns = (
        "distribution",
        "pairs per process",
        "processes",
        "max/mean unbalanced",
        "max/mean balanced",
        "lower bound",
        "step-time gain",
    )
    cells = [
        (
            row.distribution,
            str(row.pairs_per_process),
            str(row.processes),
            f"{row.unbalanced:.2f}",
            f"{row.balanced:.3f}",
            f"{row.lower_bound:.3f}",
            f"{row.step_time_gain:.2f}x",
        )
        for row in rows
    ]
    return markdown_table(columns, cells)


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--distribution",
        nargs="+",
        choices=tuple(LENGTH_MODELS),
        help="length models to draw pairs from (default: ultrafeedback capybara; with --context-parallel all three); "
        "or --dataset",
    )
    parser.add_argument(
        "--dataset",
        metavar="PATH",
        help="instead: a local JSON/JSONL file or saved `datasets` folder with prompt/chosen/rejected strings or "
        "pre-tokenized prompt_ids/chosen_ids/rejected_ids",
    )
    parser.add_argument("--split", default="train", help="the --dataset split (default: train)")
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a local tokenizer folder for --dataset's strings (default: the shipped demo tokenizer)",
    )
    parser.add_argument(
        "--model-config",
        default=DEFAULT_MODEL,
        metavar="PATH|NAME",
        help=f"a config.json or model folder, or one of {list(MODEL_SHAPES)} (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--processes",
        nargs="+",
        type=int,
        metavar="N",
        help="data-parallel processes (default: 8 64 512; with --context-parallel 8 16 32 ... 512, each C at the "
        "counts it divides)",
    )
    parser.add_argument("--pairs-per-process", nargs="+", type=int, metavar="N", help="per micro-step (default: 4 8)")
    parser.add_argument("--micro-steps", type=int, metavar="N", help="gradient accumulation (default: 1)")
    parser.add_argument(
        "--steps", type=int, default=200, metavar="N", help="optimizer steps simulated per row (default: 200)"
    )
    parser.add_argument(
        "--max-length",
        type=int,
        metavar="N",
        help="per-sequence truncation, as TRL's max_length (default: 1024, TRL's; with --context-parallel "
        "C x --rank-budget / 2, a pair that fills the group)",
    )
    parser.add_argument(
        "--prefix-sharing", action="store_true", help="cost pairs laid out with prefix_sharing=True (default: not)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the pairs drawn and the order they are dealt in (default: 0)"
    )
    parser.add_argument(
        "--context-parallel",
        type=int,
        nargs="+",
        metavar="C",
        help="simulate context-parallel groups of C ranks instead: the time to train the same pairs with every "
        "token-budget bin split over all C (static) and with micro-steps packed as rows on the ranks their lengths "
        "need (dynamic), --steps lockstep micro-steps at least; no --pairs-per-process, --micro-steps, "
        "--prefix-sharing",
    )
    parser.add_argument(
        "--rank-budget",
        type=int,
        default=context_parallel_balance.DEFAULT_RANK_BUDGET,
        metavar="T",
        help="with --context-parallel: tokens a rank holds, max_tokens_per_batch / C "
        f"(default: {context_parallel_balance.DEFAULT_RANK_BUDGET})",
    )
    parser.add_argument(
        "--pool-bins",
        type=int,
        default=context_parallel_balance.DEFAULT_POOL_BINS,
        metavar="N",
        help="with --context-parallel: the pairs drawn, about this many bins of C x --rank-budget tokens "
        f"(default: {context_parallel_balance.DEFAULT_POOL_BINS})",
    )
    parser.add_argument("--output", metavar="FILE.json", help="write the rows as JSON")
    parser.set_defaults(run=run)


def check_options(options: argparse.Namespace) -> None:
    if options.dataset and options.distribution:
        raise ValueError("--distribution and --dataset are alternatives: pass one.")
    if options.tokenizer and not options.dataset:
        raise ValueError("--tokenizer tokenizes --dataset's strings: pass --dataset too.")
    if options.context_parallel is not None:
        check_context_parallel_options(options)
        return
    options.distribution = options.distribution or SHIPPED_DISTRIBUTIONS
    options.processes = options.processes or [8, 64, 512]
    options.pairs_per_process = options.pairs_per_process or [4, 8]
    options.micro_steps = options.micro_steps or 1
    options.max_length = options.max_length or 1024
    counts = [*options.processes, *options.pairs_per_process, options.micro_steps, options.steps]
    if min(counts) < 1 or options.max_length < 3:
        raise ValueError(
            "--processes, --pairs-per-process, --micro-steps and --steps must be at least 1, --max-length at least 3."
        )


def check_context_parallel_options(options: argparse.Namespace) -> None:
    for ranks in options.context_parallel:
        if ranks < 1 or ranks & (ranks - 1):
            raise ValueError(f"--context-parallel must be powers of two (1, 2, 4 ...), not {ranks}.")
    given = [name for name in ("pairs_per_process", "micro_steps") if getattr(options, name) is not None]
    if options.prefix_sharing:
        given.append("prefix_sharing")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(
            f"{flags}: not with --context-parallel, whose micro-steps are token-budget bins of C x --rank-budget."
        )
    options.distribution = options.distribution or context_parallel_balance.DEFAULT_DISTRIBUTIONS
    options.processes = options.processes or context_parallel_balance.DEFAULT_PROCESSES
    if min(options.rank_budget, options.pool_bins, options.steps) < 1 or (options.max_length or 3) < 3:
        raise ValueError("--rank-budget, --pool-bins and --steps must be at least 1, --max-length at least 3.")
    if [count for count in options.processes if count < 1 or all(count % ranks for ranks in options.context_parallel)]:
        raise ValueError(
            f"--processes must be multiples of a --context-parallel {options.context_parallel}, not {options.processes}."
        )


def run(options: argparse.Namespace) -> int:
    check_options(options)
    if options.context_parallel is not None:
        return run_context_parallel(options)
    start = time.perf_counter()
    rows = run_balance(options)
    print(format_table(rows))
    print(
        f"\n{options.steps} steps per row, {options.micro_steps} micro-step(s), model {options.model_config}, "
        f"--max-length {options.max_length}; {time.perf_counter() - start:.1f} s."
    )
    if options.output:
        Path(options.output).write_text(json.dumps([row.to_json() for row in rows], indent=2) + "\n")
    return 0
