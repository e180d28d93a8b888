"""datasets' private names trl-padfree relies on (tests/integrations/test_seams.py checks each): the JSON builder's
`JsonConfig.chunksize`, the bytes of a file it reads before fixing the columns' types (later rows are cast to them)."""

from __future__ import annotations

from datasets.packaged_modules.json.json import JsonConfig


def json_type_sample_bytes() -> int:
    """How much of a JSON file datasets reads to decide its columns' types: a file no larger is typed whole."""
    return JsonConfig.chunksize
