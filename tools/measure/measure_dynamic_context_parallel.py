"""Measure dynamic context parallelism against static on CPU processes, and the cost model's error on the same steps.

Run from the repository root, on a quiet machine (other work on the cores shows up in every figure):

    python tools/measure/measure_dynamic_context_parallel.py --output docs/bench/dynamic_context_parallel_cpu.json

Data: `--pairs` preference pairs whose token lengths are drawn from the reasoning-trace length model
(trl_padfree/data/length_models.py, `REASONING`) scaled by `--scale` (1/8: most pairs a few hundred tokens, a tail
to ten times that, what 4 CPU processes train in minutes), a pair's completions shortened where the pair would not
fit the group's budget. Each text is a window of the shipped data's tokens of the drawn length, decoded
(`pair_texts`); the rows the runs trained record the lengths TRL's tokenization gave.

Runs, each one `accelerate launch` (trl_padfree/cli/accelerate_configs/multi_gpu.yaml: DDP over gloo on CPU
processes, one thread each) of tests/support/distributed/time_context_parallel.py over one epoch of the same pairs,
the same seed and `--rank-tokens` tokens a rank:
- static C: `context_parallel_size=C`, bins of C x rank tokens, every row over all C ranks;
- dynamic C: the same with `dynamic_context_parallel=True`, each row over 1, 2 ... C ranks;
- static C' for every C' < C (`context_parallel_size=C'`, or none at 1) whose bins of C' x rank tokens hold the
  longest pair: launched, and recorded as refused where the trainer refuses a pair that does not fit.
A first launch calibrates the cost model's `Link` on the same processes: the FLOP rate of the model's matmuls, and
the time of gloo's all-gathers by size (a fixed time per call plus bytes over bandwidth, least squares).

Per run, over the measured steps (the epoch's steps after `--warmup`): step time (the slowest process's
`on_step_begin` to `on_step_end`) and each process's own CPU time over it (4 processes on 2 cores: the wall time
holds waits for a core; the thread time is what a process on its own core or GPU would take); tokens a rank holds
per step (padding included, summed over the step's micro-steps; slowest rank and mean); bytes a rank received in the
row's all-gathers and their backward's reduce-scatters per step, counted as they ran, and as `gathered_bytes`
predicts from the rows; peak resident memory per process; real tokens per second. The cost model
(`split_row_cost` of each rank's row with the calibrated link, the slowest rank per micro-step, summed) predicts
each run's time on the very rows it trained: its error per step, and the static/dynamic ratio it predicts against
the measured one (per real token, as the runs take different numbers of steps over the same pairs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The tests' helpers, and the checkout (for tools.measure) when run as a script
sys.path[:0] = [
    str(Path(__file__).resolve().parents[2] / "tests" / "support"),
    str(Path(__file__).resolve().parents[2]),
]

from distributed_runs import ACCELERATE_CONFIGS, ROOT, checkout_environment, free_port  # noqa: E402

from tools.measure.measure_balanced_ranks import machine, model_shape, save_model  # noqa: E402
from trl_padfree.cli.bench.report import run_provenance  # noqa: E402
from trl_padfree.costs.context_parallel import (  # noqa: E402
    Link,
    exchanges_per_layer,
    gathered_bytes,
    split_row_cost,
)
from trl_padfree.costs.flops import DecoderShape, Segment  # noqa: E402
from trl_padfree.data import load_demo_dataset, load_demo_tokenizer  # noqa: E402
from trl_padfree.data.length_models import REASONING, LengthModel  # noqa: E402

WORKER = ROOT / "tests" / "support" / "distributed" / "time_context_parallel.py"
ELEMENT_BYTES = 4  # float32 keys and values on CPU
BUDGET_SLACK = 64  # tokens a drawn pair leaves free of its group's budget: TRL's special tokens, the row's padding


RECOMPUTED_EXCHANGES = exchanges_per_layer(reference_forward=True, recompute=True)  # activation checkpointing on


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="the JSON report")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--cp-size", type=int, default=4, help="C: the static and dynamic runs' context_parallel_size")
    parser.add_argument("--rank-tokens", type=int, default=1024, help="tokens a rank holds at most, every run")
    parser.add_argument("--pairs", type=int, default=192)
    parser.add_argument("--scale", type=float, default=1 / 8, help="the reasoning model's lengths times this")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps run first and not reported")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one launch may take")
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="recompute the summary and the cost model's prediction of an existing --output from its recorded runs",
    )
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------------
# The pairs


def draw_pair_lengths(model: LengthModel, scale: float, pairs: int, pair_cap: int, seed: int) -> list[dict]:
    """`pairs` prompt/chosen/rejected token lengths from `model`'s lognormals times `scale`, at least one token each;
    a pair over `pair_cap` (prompt twice, both completions) gets its completions shortened in proportion to fit."""
    generator = random.Random(seed)

    def draw(median: float, sigma: float) -> int:
        return max(1, round(scale * median * math.exp(generator.gauss(0.0, sigma))))

    drawn = []
    for _ in range(pairs):
        prompt = min(draw(model.prompt_median, model.prompt_sigma), pair_cap // 4)
        chosen = draw(model.chosen_median, model.completion_sigma)
        rejected = draw(model.rejected_median, model.completion_sigma)
        room = pair_cap - 2 * prompt
        if chosen + rejected > room:
            chosen, rejected = (
                max(1, chosen * room // (chosen + rejected)),
                max(1, rejected * room // (chosen + rejected)),
            )
        drawn.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return drawn


def pair_texts(lengths: list[dict], seed: int) -> list[dict]:
    """A text for each drawn length: a window of that many tokens of the shipped pairs' text (all of it, tokenized
    once), decoded, shortened until it tokenizes to at most the length."""
    tokenizer = load_demo_tokenizer()
    corpus = " ".join(text for pair in load_demo_dataset("train") for text in pair.values())
    ids = tokenizer(corpus, add_special_tokens=False)["input_ids"]
    generator = random.Random(seed)

    def text(tokens: int) -> str:
        start = generator.randrange(len(ids) - tokens)
        while True:
            decoded = tokenizer.decode(ids[start : start + tokens])
            if len(tokenizer(decoded, add_special_tokens=False)["input_ids"]) <= tokens or tokens == 1:
                return decoded
            tokens -= 1

    return [{column: text(length[column]) for column in ("prompt", "chosen", "rejected")} for length in lengths]


# ---------------------------------------------------------------------------------------------------------------------
# Launches


def launch(model: Path, output: Path, options: argparse.Namespace, *arguments: str) -> dict | str:
    """The worker under `accelerate launch`, DDP over gloo on CPU processes: its report, or the trainer's refusal."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / "multi_gpu.yaml"),
        "--num_processes", str(options.processes), "--mixed_precision", "no", "--main_process_port", str(free_port()),
        str(WORKER), "--model", str(model), "--output", str(output), *arguments,
    ]  # fmt: skip
    # Not `accelerate launch --cpu`: it runs the script in one process, whatever --num_processes says
    environment = checkout_environment(ACCELERATE_USE_CPU="true", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(
        command, capture_output=True, text=True, env=environment, cwd=ROOT, timeout=options.timeout
    )
    if result.returncode != 0:
        # A refusal at set-up, as each process prints it: `[rank0]: ValueError: ...`
        refusal = next((line for line in result.stderr.splitlines() if "ValueError: " in line), None)
        if refusal is not None:
            return refusal.split("ValueError: ", 1)[1]
        sys.exit(f"launch {arguments} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return json.loads(output.read_text())


# ---------------------------------------------------------------------------------------------------------------------
# The link


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares `(intercept, slope)` of y over x."""
    xs, ys = zip(*points, strict=True)
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def calibrated_links(calibration: dict) -> dict:
    """The measured rates, and a `Link` per group size: every process's matmul FLOP rate in wall time (the mean over
    processes: what a process computes while all of them run), each all-gather size's slowest process, and a line
    through those: a fixed time per call plus received bytes over bandwidth."""
    processes = calibration["processes"]
    wall_rate = statistics.mean(p["matmul_flops"] / p["matmul_wall_seconds"] for p in processes)
    thread_rate = statistics.mean(p["matmul_flops"] / p["matmul_thread_seconds"] for p in processes)
    links = {}
    for size, _ in processes[0]["gathers"].items():
        points = [
            (point["received_bytes"], max(p["gathers"][size][n]["seconds"] for p in processes))
            for n, point in enumerate(processes[0]["gathers"][size])
        ]
        latency, seconds_per_byte = fit_line(points)
        latency = max(latency, 0.0)
        links[size] = {
            "exchange_seconds": latency,
            "bytes_per_second": 1 / seconds_per_byte,
            "points": points,
            "link": Link.of_rates(wall_rate, 1 / seconds_per_byte, latency, ELEMENT_BYTES),
        }
    return {"flops_per_second_wall": wall_rate, "flops_per_second_thread": thread_rate, "by_group_size": links}


# ---------------------------------------------------------------------------------------------------------------------
# Summaries: pure arithmetic on a run's report


def measured_steps(run: dict, warmup: int) -> list[list[dict]]:
    """`steps[step][process]`, the first `warmup` steps left out."""
    steps = list(zip(*[process["steps"] for process in run["processes"]], strict=True))
    return [list(step) for step in steps[warmup:]]


def micro_steps(step: list[dict]) -> list[list[dict]]:
    """`table[micro_step][process]` of one optimizer step's micro-batches."""
    return [list(micro) for micro in zip(*[process["micro_batches"] for process in step], strict=True)]


def row_prediction(shape: DecoderShape, micro: dict, links: dict) -> float:
    """The cost model's FLOPs for one process's micro-batch: its row's slowest rank (`split_row_cost`)."""
    segments = [Segment(length, prefix) for length, prefix in micro["segments"]]
    link = links[str(micro["ranks"])]["link"] if micro["ranks"] > 1 else next(iter(links.values()))["link"]
    # TRL's default activation checkpointing, which the runs train with: the policy's forward again in its backward
    return split_row_cost(
        shape, segments, micro["scored_tokens"], micro["row_tokens"], micro["ranks"], link, recompute=True
    )


def summarize(run: dict, warmup: int, links: dict) -> dict:
    """Means over the measured steps (the module docstring), and the cost model's prediction of them."""
    shape = DecoderShape(**run["shape"])
    steps = measured_steps(run, warmup)
    rate = links["flops_per_second_wall"]
    by_size = links["by_group_size"]
    step_seconds = [max(process["wall_seconds"] for process in step) for step in steps]
    training_seconds = [sum(max(m["seconds"] for m in micro) for micro in micro_steps(step)) for step in steps]
    predicted = [
        sum(max(row_prediction(shape, m, by_size) for m in micro) for micro in micro_steps(step)) / rate
        for step in steps
    ]
    rank_tokens = [
        [sum(m["row_tokens"] / m["ranks"] for m in process["micro_batches"]) for process in step] for step in steps
    ]
    real_tokens = [
        sum(m["real_tokens"] / m["ranks"] for process in step for m in process["micro_batches"]) for step in steps
    ]
    gathered = [[process["gathered"]["keys_values"] for process in step] for step in steps]
    predicted_gathered = [
        [sum(gathered_bytes(shape, m["row_tokens"], m["ranks"], ELEMENT_BYTES, RECOMPUTED_EXCHANGES)
             for m in process["micro_batches"]) for process in step]
        for step in steps
    ]  # fmt: skip
    thread = [[process["thread_seconds"] for process in step] for step in steps]
    row_ranks = [m["ranks"] for step in steps for process in step for m in process["micro_batches"]]
    return {
        "steps": len(steps),
        "micro_steps_per_step": statistics.mean(len(step[0]["micro_batches"]) for step in steps),
        "step_seconds": statistics.mean(step_seconds),
        "training_step_seconds": statistics.mean(training_seconds),
        "thread_seconds_max": statistics.mean(max(row) for row in thread),
        "thread_seconds_mean": statistics.mean(statistics.mean(row) for row in thread),
        "thread_seconds_by_process": [sum(column) for column in zip(*thread, strict=True)],
        "real_tokens_per_step": statistics.mean(real_tokens),
        "tokens_per_second": sum(real_tokens) / sum(step_seconds),
        "tokens_per_thread_second": sum(real_tokens) / sum(max(row) for row in thread),
        "rank_tokens_max": statistics.mean(max(row) for row in rank_tokens),
        "rank_tokens_mean": statistics.mean(statistics.mean(row) for row in rank_tokens),
        "rank_tokens_micro_step_max": max(
            m["row_tokens"] / m["ranks"] for step in steps for process in step for m in process["micro_batches"]
        ),
        "ranks_per_row": len(row_ranks) / sum(1 / ranks for ranks in row_ranks),
        "gathered_bytes_max": statistics.mean(max(row) for row in gathered),
        "gathered_bytes_mean": statistics.mean(statistics.mean(row) for row in gathered),
        "predicted_gathered_bytes_mean": statistics.mean(statistics.mean(row) for row in predicted_gathered),
        "peak_rss_bytes": [process["peak_rss_bytes"] for process in run["processes"]],
        "peak_rss_bytes_built": [process["peak_rss_bytes_built"] for process in run["processes"]],
        "predicted_step_seconds": statistics.mean(predicted),
        "predicted_step_error": statistics.mean(predicted) / statistics.mean(step_seconds) - 1,
        "predicted_training_step_error": statistics.mean(predicted) / statistics.mean(training_seconds) - 1,
        "predicted_seconds_per_real_token": sum(predicted) / sum(real_tokens),
        "seconds_per_real_token": sum(step_seconds) / sum(real_tokens),
    }


def compare(static: dict, dynamic: dict) -> dict:
    """Static over dynamic, measured and predicted: time for the same real tokens, and time per step."""
    measured = static["seconds_per_real_token"] / dynamic["seconds_per_real_token"]
    predicted = static["predicted_seconds_per_real_token"] / dynamic["predicted_seconds_per_real_token"]
    return {
        "measured_time_ratio": measured,
        "predicted_time_ratio": predicted,
        "ratio_error": predicted / measured - 1,
        "measured_thread_time_ratio": dynamic["tokens_per_thread_second"] / static["tokens_per_thread_second"],
        "measured_step_ratio": static["step_seconds"] / dynamic["step_seconds"],
        "predicted_step_ratio": static["predicted_step_seconds"] / dynamic["predicted_step_seconds"],
    }


def markdown_table(summaries: dict[str, dict]) -> str:
    header = ("| run | steps | s/step (predicted) | thread s/step max / mean | tokens/s | rank tokens/step max / mean "
              "| MB gathered/step/rank (predicted) | peak RSS MB max |")  # fmt: skip
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for name, row in summaries.items():
        lines.append(
            f"| {name} | {row['steps']} | {row['step_seconds']:.2f} ({row['predicted_step_seconds']:.2f}) "
            f"| {row['thread_seconds_max']:.2f} / {row['thread_seconds_mean']:.2f} | {row['tokens_per_second']:.0f} "
            f"| {row['rank_tokens_max']:.0f} / {row['rank_tokens_mean']:.0f} "
            f"| {row['gathered_bytes_mean'] / 1e6:.1f} ({row['predicted_gathered_bytes_mean'] / 1e6:.1f}) "
            f"| {max(row['peak_rss_bytes']) / 2**20:.0f} |"
        )
    return "\n".join(lines)


def summarized(report: dict, options: argparse.Namespace) -> None:
    """The report's calibrated link, summaries and comparisons, from its calibration and recorded runs (in place)."""
    links = calibrated_links(report["calibration"])
    report["link"] = {
        "flops_per_second_wall": links["flops_per_second_wall"],
        "flops_per_second_thread": links["flops_per_second_thread"],
        "by_group_size": {
            size: {key: value for key, value in link.items() if key != "link"}
            for size, link in links["by_group_size"].items()
        },
    }
    trained = {name: run for name, run in report["runs"].items() if "refused" not in run}
    report["summary"] = {name: summarize(run, options.warmup, links) for name, run in trained.items()}
    static, dynamic = (report["summary"][f"{kind} C={options.cp_size}"] for kind in ("static", "dynamic"))
    report["static_over_dynamic"] = compare(static, dynamic)
    fitting = [name for name in trained if name.startswith("static") and name != f"static C={options.cp_size}"]
    report["best_static"] = max(
        fitting or [f"static C={options.cp_size}"], key=lambda name: report["summary"][name]["tokens_per_second"]
    )
    report["best_static_over_dynamic"] = compare(report["summary"][report["best_static"]], dynamic)


def main(argv=None) -> None:
    options = parse_args(argv)
    if options.summarize:
        report = json.loads(options.output.read_text())
        summarized(report, argparse.Namespace(**report["provenance"]["flags"]))
        options.output.write_text(json.dumps(report, indent=1))
        print(markdown_table(report["summary"]))
        return
    shape = model_shape(options.hidden_size, options.layers)
    group_budget = options.rank_tokens * options.cp_size
    lengths = draw_pair_lengths(REASONING, options.scale, options.pairs, group_budget - BUDGET_SLACK, options.seed)
    pair_totals = [2 * pair["prompt"] + pair["chosen"] + pair["rejected"] for pair in lengths]
    report = {
        "provenance": run_provenance(vars(options)),
        "machine": machine(),
        "model": {"model_type": "llama", **shape},
        "data": {
            "length_model": REASONING.name,
            "scale": options.scale,
            "how": "lognormal prompt, chosen and rejected lengths of the reasoning-trace model times the scale; a "
            f"pair over {group_budget - BUDGET_SLACK} tokens (the group's budget less {BUDGET_SLACK}) has its "
            "completions shortened in proportion; each text a window of the shipped pairs' tokens of that length, "
            "decoded",
            "pairs": options.pairs,
            "drawn_pair_tokens": {
                "median": statistics.median(pair_totals),
                "p90": sorted(pair_totals)[int(0.9 * len(pair_totals))],
                "max": max(pair_totals),
                "over_one_rank": sum(total > options.rank_tokens for total in pair_totals),
                "over_two_ranks": sum(total > 2 * options.rank_tokens for total in pair_totals),
            },
        },
        "rank_tokens": options.rank_tokens,
        "runs": {},
    }
    runs = {
        f"static C={options.cp_size}": ("--cp-size", str(options.cp_size)),
        f"dynamic C={options.cp_size}": ("--cp-size", str(options.cp_size), "--dynamic"),
    }
    ranks = 1
    while ranks < options.cp_size:
        runs[f"static C={ranks}"] = ("--cp-size", str(ranks))
        ranks *= 2
    with tempfile.TemporaryDirectory() as scratch:
        model = save_model(Path(scratch) / "model", shape)
        dataset = Path(scratch) / "pairs.json"
        dataset.write_text(json.dumps(pair_texts(lengths, options.seed)))
        print("calibrating ...", flush=True)
        report["calibration"] = launch(model, Path(scratch) / "calibration.json", options, "--calibrate")
        for name, arguments in runs.items():
            print(f"{name} ...", flush=True)
            start, load = time.perf_counter(), os.getloadavg()
            common = ("--dataset", str(dataset), "--rank-tokens", str(options.rank_tokens))
            result = launch(model, Path(scratch) / "run.json", options, *arguments, *common)
            if isinstance(result, str):
                report["runs"][name] = {"refused": result, "load_average_before": load}
                print(f"  refused: {result}", flush=True)
                continue
            report["runs"][name] = result | {
                "load_average_before": load,
                "launch_seconds": time.perf_counter() - start,
            }
            print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    report["machine"]["load_average_at_end"] = os.getloadavg()
    summarized(report, options)
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(report, indent=1))
    print(markdown_table(report["summary"]))
    print(json.dumps({key: report[key] for key in ("static_over_dynamic", "best_static", "link")}, indent=1))


if __name__ == "__main__":
    main()
