"""Every refusal of padding-free training, each once: what is refused, why, and what to do instead.

Each rule is one function of plain values that raises `ValueError` (a setting to change) or `RuntimeError` (a library
that no longer does what the pinned version did) with advice that works when followed; the config, the trainer, the
forward and the engines call these where the information is first known. The rules live by concern, one module each:

    config        what `DPOConfig` cannot take               forward       the packed forward and its attention calls
    models        a model and its attention (at set-up)      parallel      rows split over ranks; ZeRO-3's equal calls
    vision        images in a batch                          token_budget  token budgets and balanced batches
    data          the preference data, as TRL reads it       placement     where the reference model lives
    batches       the collator and accelerate's hand-out

This package imports nothing else of trl-padfree, so a rule cannot grow a second copy elsewhere; docs/reference/errors.md
is generated from it (tools/generate_docs.py). Whether a model's architecture packs is measured on a tiny twin of it
(modeling/check/packability.py), which turns that measurement into a refusal here. Callers import each rule from
its module (`from trl_padfree.refusals.config import check_at_least_one`).
"""
