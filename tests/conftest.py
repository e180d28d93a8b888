import os

os.environ.setdefault("TQDM_DISABLE", "1")  # keep the test log readable; set before TRL reads it
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download anything
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
