"""The token-length models of the shipped data: what tools/generate_data.py sized the pairs from, and what
`trl-padfree bench` samples its `ultrafeedback` and `capybara` distributions from (sources in docs/guides/quickstart.md),
and a long-tailed one `trl-padfree balance` simulates context parallelism on (`REASONING`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LengthModel:
    """Lognormal token lengths of one kind of pair, before the caps. Medians in tokens, sigmas of log-length."""

    name: str
    prompt_median: float
    prompt_sigma: float
    chosen_median: float
    rejected_median: float
    completion_sigma: float


# Fitted so that, before the caps, median(prompt + chosen + rejected) and median(prompt / mean completion) match the
# prefix-sharing paper (arXiv 2410.20305, table of dataset lengths): UltraFeedback 409 and 0.42, Capybara 1160 and
# 1.59; Capybara's sigmas also give p95/median of the pair = 3.1, as its packing length 3968 = 1.1 x p95 implies.
# Chosen is 10% longer than rejected (the length bias of preference data; an estimate). See docs/guides/quickstart.md.
SINGLE_TURN = LengthModel("single-turn (UltraFeedback-like)", 66, 0.9, 155, 127, 0.7)
MULTI_TURN = LengthModel("multi-turn (Capybara-like)", 459, 1.1, 284, 232, 0.7)
# Long reasoning traces as preference pairs (two sampled traces of one problem): short prompts, long completions with a
# heavy tail. An estimate, not fitted to a dataset: at max_length 65536, 57% of pairs (prompt twice + both traces)
# hold 1-4K tokens, the median 3.2K, 1 in 100 over 25K and 1 in 200 over 32K (tests/cli/test_context_parallel_balance.py)
REASONING = LengthModel("reasoning traces (estimate)", 150, 0.9, 1100, 950, 1.2)
