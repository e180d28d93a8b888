"""The architecture check's verdict on image data for a saved vision-language model loaded under DeepSpeed ZeRO-3's
`zero.Init` (one process over gloo), as a trainer launched with ZeRO-3 judges it, printed as JSON on the last line:

    python verdict_under_zero3_init.py MODEL_DIR ATTN_IMPLEMENTATION PORT [--import-first]
    {"exact": true, "reason": null}

Run it in a fresh interpreter: what it shows depends on which modeling modules are imported before `zero.Init` runs.
With `--import-first` the modules of the model's parts are imported first, as `trl_padfree.DPOTrainer` does under
ZeRO-3 (`modeling_modules_imported`); without it, as a plain `from_pretrained` would, inside `zero.Init`.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("attn_implementation")
    parser.add_argument("port", help="a free port for the one-process gloo group")
    parser.add_argument("--import-first", action="store_true")
    options = parser.parse_args()
    os.environ |= {"DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": options.port}
    import deepspeed
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from trl_padfree.integrations.transformers import modeling_modules_imported
    from trl_padfree.modeling.check.packability import architecture_verdict

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    if options.import_first:
        modeling_modules_imported(AutoConfig.from_pretrained(options.model_dir))
    model = AutoModelForImageTextToText.from_pretrained(options.model_dir, dtype=torch.float32)
    assert all(hasattr(parameter, "ds_tensor") for parameter in model.parameters()), "zero.Init did not partition it"
    verdict = architecture_verdict(model, options.attn_implementation, images=True)
    del zero3
    print(json.dumps({"exact": verdict.exact, "reason": verdict.reason}))


if __name__ == "__main__":
    main()
