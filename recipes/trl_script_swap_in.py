"""TRL's own DPO script with only its imports swapped to trl_padfree: the swap-in, shown on TRL's code.

    python recipes/trl_script_swap_in.py dpo_padfree.py     # writes the script and prints the diff
    accelerate launch dpo_padfree.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/ultrafeedback_binarized --padding_free true --output_dir out

The script is read from the installed TRL (`trl/scripts/dpo.py`), not shipped here, so it is always the one your TRL
version runs. After each `from trl import ...` that brings in `DPOTrainer` or `DPOConfig`, one line rebinds that name
to trl_padfree's; nothing else changes.
"""

import argparse
import difflib
import re
import sys
from pathlib import Path

import trl

SWAPPED_NAMES = ("DPOTrainer", "DPOConfig")


def swap_imports(source: str) -> str:
    """TRL's script with `from trl_padfree import <name>` after every `from trl import` line that imports it."""
    lines, swapped = [], set()
    for line in source.splitlines(keepends=True):
        lines.append(line)
        match = re.match(r"(\s*)from trl import (.*)", line)
        if not match:
            continue
        imported = {name.strip() for name in match.group(2).split(",")}
        for name in SWAPPED_NAMES:
            if name in imported:
                lines.append(f"{match.group(1)}from trl_padfree import {name}  # swap-in: padding-free DPO\n")
                swapped.add(name)
    missing = set(SWAPPED_NAMES) - swapped
    if missing:
        raise ValueError(f"TRL's DPO script no longer imports {sorted(missing)} with `from trl import`.")
    return "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="where to write the swapped script")
    options = parser.parse_args()
    original_path = Path(trl.__file__).parent / "scripts" / "dpo.py"
    original = original_path.read_text()
    swapped = swap_imports(original)
    options.output.write_text(swapped)
    diff = difflib.unified_diff(
        original.splitlines(keepends=True), swapped.splitlines(keepends=True), str(original_path), str(options.output)
    )
    sys.stdout.writelines(diff)


if __name__ == "__main__":
    main()
