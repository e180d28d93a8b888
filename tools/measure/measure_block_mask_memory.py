"""Peak memory of building FlexAttention's block mask of a packed row on CPU: trl-padfree's, from the row's host
boundaries (attention/fused.py, `DocumentTiles`), and FlexAttention's own `create_block_mask` over the same mask,
which evaluates every query-key pair. A row of four causal segments; torch's allocations read from the profiler's
memory events (summed in time order, the peak above the start) plus Python's from tracemalloc
(`tests/test_fused_compile.peak_bytes`).

    PYTHONPATH=.:tests python tools/measure/measure_block_mask_memory.py   # from the repository root
"""

import argparse

import torch
from test_fused_compile import peak_build_bytes, peak_bytes
from torch.nn.attention.flex_attention import create_block_mask

from trl_padfree.modeling.attention.fused import key_ranges


def dense_peak(total: int) -> int:
    quarter = total // 4
    bounds = [0, quarter - 7, 2 * quarter - 4, 3 * quarter - 3, total]
    first, end = key_ranges(bounds, bounds, None, True)

    def mask_mod(batch, head, q_index, k_index):
        return (k_index >= first[q_index]) & (k_index < end[q_index])

    return sum(peak_bytes(lambda: create_block_mask(mask_mod, None, None, total, total, device="cpu")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--dense-up-to", type=int, default=16384, help="create_block_mask only up to this length")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, CPU, peak MiB of building one row's block mask (torch + Python allocations)")
    for total in args.tokens:
        built = sum(peak_build_bytes(total)) / 2**20
        dense = f"{dense_peak(total) / 2**20:9.1f}" if total <= args.dense_up_to else "   (skip)"
        print(f"T = {total:6}   from host boundaries {built:7.2f}   create_block_mask {dense}")


if __name__ == "__main__":
    main()
