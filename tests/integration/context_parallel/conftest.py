"""The context-parallel tests' model: a tiny Llama with 6 attention heads (Ulysses could split it over 2, 3 or 6 ranks,
not over 4), saved like a checkpoint so every process loads it by path."""

import pytest


@pytest.fixture(scope="module")
def six_head_model(tmp_path_factory):
    from trl_padfree.data import load_demo_tokenizer
    from trl_padfree.tiny import make_model

    directory = tmp_path_factory.mktemp("six_heads")
    tokenizer = load_demo_tokenizer()
    shape = dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2
    )
    make_model("llama", vocab_size=len(tokenizer), **shape).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
