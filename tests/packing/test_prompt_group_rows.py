"""Prompt groups in a packed row (prefix sharing, packing/prefix_sharing.py `grouped_row_layout`): the sequences of a
batch whose truncated prompts are identical lay the prompt out once, each distinct completion once, and every pair
reads its chosen and rejected log-probs from those segments.

    K = 4 all pairs    a>b a>c a>d b>c b>d c>d: 12 sequences of 4 distinct completions
    grouped row        | p0 p1 p2 p3 a0 a1 | p3 b0 | p3 c0 c1 c2 | p3 d0 d1 |

The layout against hand-computed rows, its padded views and attention against the unshared row's, the hybrid mixers'
and the context-parallel chunks' view of it; then one training step on K = 4 completions paired all ways against
padded TRL under every loss type, the kernel calls counted through the strict stand-ins, and the tokens computed.
"""

import dataclasses
import math
import random
from collections import defaultdict

import pytest
import torch
import trainer_utils
from datasets import Dataset
from hot_path_counts import step_counts
from shared_prefix_rows import HEAD_DIM, HEADS, KV_HEADS, dense_attention, layout_mask, row_qkv
from stand_in_kernels import calls_of
from tiny_fixtures import WORDS, make_model
from tolerances import ATTENTION_ATOL, FIRST_LOSS_ATOL, LOG_PROB_ATOL, LOSS_ATOL, LOSS_RTOL
from trainer_utils import LOSS_TYPES, assert_same_step, first_batch, make_trainer, one_step

from trl_padfree import ATTN_IMPLEMENTATION
from trl_padfree.data.scored_pairs import pair_scored_completions
from trl_padfree.modeling.attention.interface import padfree_varlen_attention
from trl_padfree.modeling.attention.rows import row_in_flight
from trl_padfree.modeling.mixers import MixerSegments
from trl_padfree.modeling.packed_forward import PackedBatch
from trl_padfree.packing.balance import row_cost
from trl_padfree.packing.collator import concatenated_inputs
from trl_padfree.packing.layout import pair_tokens
from trl_padfree.packing.prefix_sharing import pair_row_tokens, shared_prefix_keys
from trl_padfree.parallel.context import ContextParallelRow
from trl_padfree.parallel.groups import RowGroup

SHARE = dict(prefix_sharing=True, prefix_sharing_min_prompt_tokens=2)
PROMPT, OTHER_PROMPT = [1, 2, 3, 4], [20, 21, 22, 23, 24, 25, 26]
A, B, C, D = [5, 6], [7], [8, 9, 10], [11, 12]  # completions, best first


def all_pairs(prompt, completions):
    """Every better completion against every worse one, best first (`data.scored_pairs`' "all_pairs")."""
    return [
        {"prompt_ids": prompt, "chosen_ids": completions[i], "rejected_ids": completions[j]}
        for i in range(len(completions))
        for j in range(i + 1, len(completions))
    ]


def sequences_of(batch) -> list[list[int]]:
    """Each sequence's tokens, read from the row through the padded view."""
    packed = PackedBatch.from_collated(batch)
    tokens = packed.padded(packed.input_ids, -1)
    return [row[row >= 0].tolist() for row in tokens]


def unshared_sequences(examples) -> list[list[int]]:
    chosen = [example["prompt_ids"] + example["chosen_ids"] for example in examples]
    return chosen + [example["prompt_ids"] + example["rejected_ids"] for example in examples]


# ---------------------------------------------------------------------------------------------------------------------
# The layout


def test_four_completions_paired_all_ways_lay_out_one_prompt_and_four_completions():
    batch = concatenated_inputs(all_pairs(PROMPT, [A, B, C, D]), **SHARE)
    # prefix p0 p1 p2, then a (whole) and the branches b, c, d, each opening with the last prompt token
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 4, 7, 4, 8, 9, 10, 4, 11, 12]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 3, 4, 5, 6, 3, 4, 5]]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 0, 1, 1]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 6, 8, 12, 15]  # 4 segments for 12 sequences
    # chosen a a a b b c, rejected b c d c d d: every a reads segment 0, every b segment 1, ...
    assert batch["seq_starts"].tolist() == [0, 0, 0, 6, 6, 8, 6, 8, 12, 8, 12, 12]
    assert batch["shared_prefix_starts"].tolist() == [0] * 12
    assert batch["shared_prefix_lens"].tolist() == [0, 0, 0, 3, 3, 3, 3, 3, 3, 3, 3, 3]
    assert batch["seq_lens"].tolist() == [6, 6, 6, 5, 5, 7, 5, 7, 6, 7, 6, 6]
    assert sequences_of(batch) == unshared_sequences(all_pairs(PROMPT, [A, B, C, D]))
    host = batch["host_row"]
    assert host.real_row_tokens == 15 and host.laid_out == (0, 3, 5, 8) and host.shared_pairs == 6
    assert host.scored_tokens == 8  # each completion token scored once


def test_best_against_each_worse_one_reads_the_same_segment():
    examples = [{"prompt_ids": PROMPT, "chosen_ids": A, "rejected_ids": worse} for worse in (B, C, D)]
    batch = concatenated_inputs(examples, **SHARE)
    assert batch["seq_starts"].tolist()[:3] == [0, 0, 0] and batch["shared_prefix_lens"].tolist()[:3] == [0, 0, 0]
    assert batch["input_ids"].shape[1] == len(PROMPT) + len(A + B + C + D) + 3
    assert sequences_of(batch) == unshared_sequences(examples)
    # The same completion under another prompt is another sequence
    other = concatenated_inputs([*examples, {"prompt_ids": OTHER_PROMPT, "chosen_ids": A, "rejected_ids": B}], **SHARE)
    assert len(set(other["seq_starts"].tolist())) == 4 + 2


def test_a_mixed_batch_groups_what_shares_and_lays_out_the_rest_as_before():
    lone = {"prompt_ids": [30, 31, 32], "chosen_ids": [33], "rejected_ids": [34, 35]}
    short = {"prompt_ids": [40], "chosen_ids": [41, 42], "rejected_ids": [41, 42]}  # equal, but a 1-token prompt
    examples = [
        *all_pairs(PROMPT, [A, B, C])[:2],
        lone,
        *all_pairs(OTHER_PROMPT, [D, B, C]),
        short,
        all_pairs(PROMPT, [A, B, C])[2],
    ]
    batch = concatenated_inputs(examples, **SHARE, pad_to_multiple_of=8)
    # Groups in order of first appearance: PROMPT (a, b, c), the lone pair, OTHER_PROMPT (d, b, c), the short pair
    lone_alone = concatenated_inputs([lone], **SHARE)["input_ids"][0].tolist()
    expected = [1, 2, 3, 4, 5, 6, 4, 7, 4, 8, 9, 10] + lone_alone + [20, 21, 22, 23, 24, 25, 26, 11, 12, 26, 7]
    expected += [26, 8, 9, 10] + [40, 41, 42, 40, 41, 42]
    assert batch["input_ids"][0].tolist() == expected  # 40 tokens: a multiple of 8, no padding segment
    assert batch["cu_seq_lens_q"].tolist() == [0, 6, 8, 12, 16, 19, 28, 30, 34, 37, 40]
    assert sequences_of(batch) == unshared_sequences(examples)
    host = batch["host_row"]
    assert host.shared_pairs == 7 and host.real_row_tokens == 40 and batch["input_ids"].shape[1] == 40
    # The per-sequence view of the unshared row, cell for cell
    unshared = PackedBatch.from_collated(concatenated_inputs(examples))
    grouped = PackedBatch.from_collated(batch)
    for name in ("input_ids", "completion_mask", "attention_mask"):
        assert torch.equal(grouped.padded_inputs(0)[name], unshared.padded_inputs(0)[name]), name


def random_group_examples(seed: int, vocab_size: int = 60) -> list[dict]:
    """A batch of prompt groups with awkward lengths: K = 1..5 completions of 0..12 prompt tokens (some equal
    completions, some one token), paired all ways or best against worst, shuffled."""
    rng = random.Random(seed)

    def tokens(count):
        return [rng.randrange(4, vocab_size) for _ in range(count)]

    examples = []
    for _ in range(rng.randint(1, 4)):
        prompt = tokens(rng.randint(1, 12))
        completions = [tokens(rng.choice([1, 1, 2, 5, 9])) for _ in range(rng.randint(2, 5))]
        completions.append(rng.choice(completions))  # a completion twice
        pairs = all_pairs(prompt, completions)
        examples += pairs if rng.random() < 0.7 else [pairs[0]]
    rng.shuffle(examples)
    return examples


@pytest.mark.parametrize(
    "options",
    [dict(), dict(max_length=9), dict(max_length=9, truncation_mode="keep_end"), dict(pad_to_multiple_of=16)],
    ids=["untruncated", "keep_start", "keep_end", "padded_to_16"],
)
def test_padded_views_of_random_groups_equal_the_unshared_rows(options):
    saved = 0
    for seed in range(20):
        examples = random_group_examples(seed)
        unshared = PackedBatch.from_collated(concatenated_inputs(examples, **options))
        grouped = PackedBatch.from_collated(concatenated_inputs(examples, **SHARE, **options))
        saved += unshared.real_row_tokens - grouped.real_row_tokens
        for name in ("input_ids", "completion_mask", "attention_mask"):
            assert torch.equal(grouped.padded_inputs(0)[name], unshared.padded_inputs(0)[name]), (seed, name)
        # Every next-token cell that scores a completion token reads a position whose next row token is that token
        labels = grouped.labels()[0]
        next_tokens = torch.cat([labels[1:], labels.new_tensor([-100])])
        scored = grouped.padded_shifted(next_tokens.unsqueeze(0), fill_value=-100)
        assert torch.equal(scored, unshared.padded(unshared.labels(), fill_value=-100)[:, 1:]), seed
    assert saved > 0


def test_truncation_groups_the_sequences_that_kept_the_same_tokens():
    prompt = [1, 2, 3, 4, 5]
    examples = [
        {"prompt_ids": prompt, "chosen_ids": [6, 7, 8, 9], "rejected_ids": [6, 7, 10]},
        {"prompt_ids": prompt, "chosen_ids": [11, 12, 13, 14, 15], "rejected_ids": [16]},
    ]
    # keep_start at 7: completions cut to 2 tokens, so [6, 7...] twice is one sequence; one prompt for all
    batch = concatenated_inputs(examples, max_length=7, **SHARE)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 5, 11, 12, 5, 16]]
    assert batch["seq_starts"].tolist() == [0, 7, 0, 10]
    assert sequences_of(batch) == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 11, 12]] + [
        [1, 2, 3, 4, 5, 6, 7],
        prompt + [16],
    ]
    # keep_end at 7: each sequence keeps its prompt's last 7 - completion tokens, [3, 4, 5], [2, 3, 4, 5], [4, 5] and
    # the whole prompt: four prompts, nothing shared
    batch = concatenated_inputs(examples, max_length=7, truncation_mode="keep_end", **SHARE)
    assert batch["shared_prefix_lens"].tolist() == [0, 0, 0, 0]
    assert batch["input_ids"].shape[1] == 7 + 7 + 7 + 6
    # A third pair: its chosen sequence is the first one's; its rejected one kept [3, 4, 5] too, a branch of it
    examples.append({"prompt_ids": prompt, "chosen_ids": [6, 7, 8, 9], "rejected_ids": [17, 18, 19, 20]})
    batch = concatenated_inputs(examples, max_length=7, truncation_mode="keep_end", **SHARE)
    host = batch["host_row"]
    assert host.seq_starts[0] == host.seq_starts[2] and host.prefix_lens[5] == 2
    assert host.prefix_starts[5] == host.seq_starts[0]
    assert batch["input_ids"].shape[1] == 7 + 7 + 7 + 6 + 5
    assert sequences_of(batch) == [
        [3, 4, 5, 6, 7, 8, 9], [4, 5, 11, 12, 13, 14, 15], [3, 4, 5, 6, 7, 8, 9],
        [2, 3, 4, 5, 6, 7, 10], [1, 2, 3, 4, 5, 16], [3, 4, 5, 17, 18, 19, 20],
    ]  # fmt: skip


def test_distinct_prompts_keep_the_pair_by_pair_layout_and_its_token_count():
    rng = random.Random(5)
    for _ in range(30):
        shape = [(rng.randint(1, 12), rng.randint(1, 9), rng.randint(1, 9)) for _ in range(rng.randint(1, 5))]
        examples = [
            {"prompt_ids": [100 + pair] * p, "chosen_ids": [4] * c, "rejected_ids": [5] * r}
            for pair, (p, c, r) in enumerate(shape)
        ]
        batch = concatenated_inputs(examples, **SHARE)
        assert batch["input_ids"].shape[1] == sum(pair_row_tokens(*each, None, "keep_start", 2) for each in shape)
        assert len(batch["cu_seq_lens_q"]) - 1 == 2 * len(shape)


# ---------------------------------------------------------------------------------------------------------------------
# What reads the layout: padded views' gradients, attention, mixers, context-parallel chunks, costs


def test_sequences_that_read_the_same_positions_sum_their_gradients():
    batch = concatenated_inputs(all_pairs(PROMPT, [A, B, C, D]), **SHARE)
    packed = PackedBatch.from_collated(batch)
    row = torch.zeros(1, packed.row_length, requires_grad=True)
    packed.padded(row)[packed.token_valid].sum().backward()
    # a's tokens are read by 3 sequences; the prefix by all 12 (p3 of the first segment by a's 3 only)
    readers = [12, 12, 12, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]
    assert row.grad[0].tolist() == readers


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_grouped_attention_is_one_call_equal_to_dense_attention_with_the_layout_mask(sliding_window):
    batch = concatenated_inputs(random_group_examples(3), **SHARE, pad_to_multiple_of=8)
    packed = PackedBatch.from_collated(batch)
    query, key, value = row_qkv(packed.row_length)
    row = packed.row()
    output, _ = padfree_varlen_attention(
        torch.nn.Module(), query, key, value, None, sliding_window=sliding_window, packed_row=row
    )
    assert row.shared.bounds_q == packed.host.cu_seq_lens  # one layout: the row's segments as queries
    expected = dense_attention(query, key, value, layout_mask(batch, sliding_window))
    torch.testing.assert_close(output, expected, atol=ATTENTION_ATOL, rtol=0)
    grads = torch.autograd.grad(output.square().sum(), (query, key, value))
    expected_grads = torch.autograd.grad(expected.square().sum(), (query, key, value))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma3_text"])
def test_grouped_forward_equals_unshared_forward(model_type):
    model = make_model(model_type, attn_implementation=ATTN_IMPLEMENTATION).eval()
    examples = random_group_examples(1)

    @torch.no_grad()
    def log_probs(batch):
        packed = PackedBatch.from_collated(batch)
        logits = model(**packed.model_kwargs()).logits.float().log_softmax(-1)
        return packed.padded(logits)[packed.token_valid]

    unshared = log_probs(concatenated_inputs(examples, pad_to_multiple_of=8))
    grouped = log_probs(concatenated_inputs(examples, **SHARE, pad_to_multiple_of=8))
    assert (grouped - unshared).abs().max().item() <= LOG_PROB_ATOL


def test_mixers_see_every_sequence_whole_one_segment_each():
    # One segment per sequence, as without groups: per-segment mixer calls must be as many on every ZeRO-3 process
    examples = all_pairs(PROMPT, [A, B, C, D])
    packed = PackedBatch.from_collated(concatenated_inputs(examples, **SHARE, pad_to_multiple_of=8))
    segments = MixerSegments.of_packed_batch(packed)
    mixer_row = packed.input_ids[0, segments.gather_index].tolist()
    assert [mixer_row[start:end] for start, end in segments.bounds[:-1]] == unshared_sequences(examples)
    assert segments.bounds[-1][1] - segments.bounds[-1][0] == packed.row_length - packed.real_row_tokens
    assert segments.gather_index[segments.output_index].tolist() == list(range(packed.row_length))
    # A pair whose two sequences are one (no prefix read anywhere) still runs both
    equal = {"prompt_ids": PROMPT, "chosen_ids": A, "rejected_ids": A}
    segments = MixerSegments.of_packed_batch(PackedBatch.from_collated(concatenated_inputs([equal], **SHARE)))
    assert segments.bounds == [(0, 6), (6, 12)]


def test_context_parallel_chunks_of_a_grouped_row_equal_the_whole_row():
    batch = concatenated_inputs(random_group_examples(7), **SHARE, pad_to_multiple_of=12)
    packed = PackedBatch.from_collated(batch)
    length = packed.row_length
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(1, HEADS, length, HEAD_DIM, generator=generator)
    key, value = (torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator) for _ in range(2))
    expected, _ = padfree_varlen_attention(torch.nn.Module(), query, key, value, None, packed_row=packed.row())
    layer = type("Layer", (torch.nn.Module,), {"is_causal": True})()
    for ranks in (2, 3, 4):
        chunk, outputs = length // ranks, []
        for rank in range(ranks):
            row = ContextParallelRow(
                packed.cu_seq_lens, None, group=RowGroup(None, rank, ranks), row_length=length,
                shared_prefix=shared_prefix_keys(packed.host), bounds=packed.host.cu_seq_lens,
            )  # fmt: skip
            row.gather_keys_and_values = lambda chunk_key, chunk_value: (key, value)
            mine = slice(rank * chunk, (rank + 1) * chunk)
            with row_in_flight(row):
                output, _ = padfree_varlen_attention(
                    layer, query[:, :, mine], key[:, :, mine], value[:, :, mine], None, packed_row=row
                )
            outputs.append(output)
        torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=ATTENTION_ATOL, rtol=0)


def test_a_grouped_rows_cost_counts_each_distinct_sequence_once():
    from trl_padfree.costs.flops import DecoderShape

    shape = DecoderShape(
        linear_params=1000, hidden_size=16, vocab_size=50, attention_layers=2, num_attention_heads=2, head_dim=8
    )
    grouped = concatenated_inputs(all_pairs(PROMPT, [A, B, C, D]), **SHARE)["host_row"]
    alone = [
        concatenated_inputs([{"prompt_ids": PROMPT, "chosen_ids": A, "rejected_ids": other}], **SHARE)["host_row"]
        for other in (B, C, D)
    ]  # a's pairs with b, c and d: one prompt, a once, b, c and d once each
    assert row_cost(shape, grouped) < sum(row_cost(shape, host) for host in alone)
    # The segments of two pairs of the prompt, a > b and c > d: | p0 p1 p2 p3 a0 a1 | p3 b0 | p3 c0 c1 c2 | p3 d0 d1 |
    two_pairs = [
        {"prompt_ids": PROMPT, "chosen_ids": A, "rejected_ids": B},
        {"prompt_ids": PROMPT, "chosen_ids": C, "rejected_ids": D},
    ]
    assert row_cost(shape, grouped) == row_cost(shape, concatenated_inputs(two_pairs, **SHARE)["host_row"])


# ---------------------------------------------------------------------------------------------------------------------
# The trainer: K = 4 completions paired all ways, one step against padded TRL

GROUPED_BATCH = 14  # two prompts' six pairs, a lone pair and a pair with a one-word prompt


def k4_dataset() -> Dataset:
    """Two prompts with 4 scored completions each, paired all ways (6 pairs each, `data.scored_pairs`), then a prompt
    with 2 and a one-word prompt with 2: 14 pairs, with awkward lengths."""
    rng = random.Random(0)

    def sentence(words):
        return " ".join(rng.choice(WORDS) for _ in range(words))

    prompts = [sentence(9), sentence(3), sentence(5), sentence(1)]
    completions = [
        [" " + sentence(words) for words in lengths] for lengths in ([1, 6, 3, 11], [4, 1, 8, 2], [7, 2], [3, 5])
    ]
    scores = [[4, 1, 3, 2], [2, 4, 1, 3], [1, 2], [2, 1]]
    scored = Dataset.from_dict({"prompt": prompts, "completions": completions, "scores": scores})
    return pair_scored_completions(scored, "all_pairs").select_columns(["prompt", "chosen", "rejected"])


@pytest.fixture
def k4_pairs(monkeypatch):
    """`make_trainer` on `k4_dataset`, in batches of all 14 pairs."""
    monkeypatch.setattr(trainer_utils, "make_preference_dataset", lambda *args, **kwargs: k4_dataset())
    return dict(num_pairs=GROUPED_BATCH, batch_size=GROUPED_BATCH)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_step_equals_padded_trl_under_every_loss_type(k4_pairs, loss_type):
    padded = one_step(make_trainer(False, loss_type=[loss_type], **k4_pairs))
    grouped = one_step(make_trainer(True, loss_type=[loss_type], **SHARE, **k4_pairs))
    assert_same_step(padded, grouped)
    assert grouped.metrics["padfree/shared_pairs"] == 13 / 14  # all but the one-word prompt's


@pytest.mark.parametrize(
    "options",
    [dict(ld_alpha=0.5), dict(use_weighting=True), dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])],
    ids=["ld_alpha", "wpo", "rpo"],
)
def test_per_token_options_equal_padded_trl(k4_pairs, options):
    assert_same_step(
        one_step(make_trainer(False, **options, **k4_pairs)),
        one_step(make_trainer(True, **options, **SHARE, **k4_pairs)),
    )


def test_precomputed_reference_log_probs_equal_padded_trl(k4_pairs):
    padded = make_trainer(False, precompute_ref_log_probs=True, **k4_pairs)
    grouped = make_trainer(True, precompute_ref_log_probs=True, **SHARE, **k4_pairs)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        torch.testing.assert_close(
            torch.tensor(grouped.train_dataset[column]),
            torch.tensor(padded.train_dataset[column]),
            atol=LOSS_ATOL,
            rtol=LOSS_RTOL,
        )
    assert_same_step(one_step(padded), one_step(grouped))


def test_first_loss_is_ln2_when_policy_equals_reference(k4_pairs):
    loss = one_step(make_trainer(True, **SHARE, ref_seed=0, **k4_pairs)).loss
    assert loss == pytest.approx(math.log(2), abs=FIRST_LOSS_ATOL)


def row_tokens_by_layout(pairs: list[dict]) -> dict[str, int]:
    """Tokens one step's row computes: padded TRL (every sequence padded to the longest), unshared and per-pair
    sharing (each pair's prompt once), prompt groups (each prompt once, each distinct completion once, plus the last
    prompt token every branch repeats), and the FLOP ideal (each prompt and each distinct completion once)."""
    groups = defaultdict(set)
    for pair in pairs:
        groups[tuple(pair["prompt_ids"])] |= {tuple(pair["chosen_ids"]), tuple(pair["rejected_ids"])}
    sizes = [(len(p["prompt_ids"]), len(p["chosen_ids"]), len(p["rejected_ids"])) for p in pairs]
    longest = max(prompt + max(chosen, rejected) for prompt, chosen, rejected in sizes)
    ideal = sum(len(prompt) + sum(map(len, completions)) for prompt, completions in groups.items())
    grouped = sum(
        len(prompt) + sum(map(len, completions)) + len(completions) - 1
        if len(prompt) >= 2
        else sum(len(prompt) + len(completion) for completion in completions)  # unshared: each sequence whole
        for prompt, completions in groups.items()
    )
    # (the one-word prompt's pair: its two sequences whole, as unshared)
    return {
        "padded": 2 * len(pairs) * longest,
        "unshared": sum(pair_tokens(*size, None) for size in sizes),
        "per_pair": sum(pair_row_tokens(*size, None, "keep_start", 2) for size in sizes),
        "grouped": grouped,
        "ideal": ideal,
    }


def test_tokens_computed_per_step_fall_by_the_predicted_factor(k4_pairs):
    trainer = make_trainer(True, **SHARE, **k4_pairs)
    pairs = [trainer.train_dataset[index] for index in range(GROUPED_BATCH)]
    predicted = row_tokens_by_layout(pairs)
    batch = first_batch(trainer)
    assert batch["input_ids"].shape[1] == batch["host_row"].real_row_tokens == predicted["grouped"]
    # K = 4 all ways: per-pair sharing runs each prompt 6 times and each completion 3 times, groups once each
    assert predicted["grouped"] < predicted["per_pair"] < predicted["unshared"] < predicted["padded"]
    # The last prompt token each branch repeats (3 per K = 4 group, 1 for the lone pair), and the one-word prompt,
    # too short to share, laid out with both its sequences
    assert predicted["grouped"] - predicted["ideal"] == 3 + 3 + 1 + 1
    metrics = one_step(trainer).metrics
    assert metrics["padfree/shared_tokens"] == predicted["unshared"] - predicted["grouped"]
    assert metrics["padfree/real_tokens"] == predicted["unshared"]


def test_attention_calls_make_one_kernel_call_over_the_grouped_row_in_trls_default_precision(monkeypatch, k4_pairs):
    reads, attention = step_counts(monkeypatch, True, bf16=True, **SHARE, **k4_pairs)
    assert len(attention.calls) == 4  # 2 layers, policy and reference
    for host_reads, _, kernels in attention.calls:
        assert host_reads == 0 and kernels == 1
    trainer = make_trainer(True, **SHARE, **k4_pairs)
    host = first_batch(trainer)["host_row"]
    assert len(host.cu_seq_lens) - 1 < len(host.seq_lens) // 2  # fewer segments than pairs
    forwards = calls_of("varlen_attn")
    assert len(forwards) == 4
    for call in forwards:  # each over the grouped row's segments: one gathered-key layout
        assert call.boundaries.tolist() == list(host.cu_seq_lens)


def test_a_hybrid_model_groups_and_equals_padded_trl(k4_pairs):
    from tiny_architectures import model_factory

    options = dict(model_factory=model_factory("qwen3_5_text"), **k4_pairs)
    assert_same_step(one_step(make_trainer(False, **options)), one_step(make_trainer(True, **SHARE, **options)))


def test_auto_prices_the_grouped_row_and_equals_padded_trl(k4_pairs):
    trainer = make_trainer(True, prefix_sharing="auto", **k4_pairs)
    assert_same_step(one_step(make_trainer(False, **k4_pairs)), one_step(trainer))
    # Without a model to weigh, "auto" lays the groups out
    examples = [trainer.train_dataset[index] for index in range(GROUPED_BATCH)]
    collator = dataclasses.replace(trainer.data_collator, prefix_sharing_cost=None)
    assert collator(examples)["host_row"].real_row_tokens < sum(collator(examples)["seq_lens"].tolist())
