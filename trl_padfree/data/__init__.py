"""The preference data and tokenizer shipped in the package, for the demo, the recipes and the tests (no download).

The files are written by tools/generate_data.py in the repository (see docs/guides/quickstart.md): English-like chats
composed from phrase banks, with token lengths modelled on UltraFeedback and Capybara (`length_models`), and a
byte-level BPE tokenizer trained on them. The files and their loaders are in shipped.py, `length_statistics` in
lengths.py. `pair_scored_completions` and `pair_ultrafeedback` (scored_pairs.py) turn prompts with K scored completions
into preference pairs that carry their prompt's id.
"""

from .lengths import length_statistics
from .scored_pairs import pair_scored_completions, pair_ultrafeedback
from .shipped import DATA_DIR, DEMO_DATASET_NAME, SPLIT_FILES, TOKENIZER_FILE, load_demo_dataset, load_demo_tokenizer

__all__ = [
    "DATA_DIR",
    "DEMO_DATASET_NAME",
    "SPLIT_FILES",
    "TOKENIZER_FILE",
    "length_statistics",
    "load_demo_dataset",
    "load_demo_tokenizer",
    "pair_scored_completions",
    "pair_ultrafeedback",
]
