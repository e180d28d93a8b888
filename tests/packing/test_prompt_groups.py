"""Prompt groups, the parts apart from the trainer: pairs from prompts with K scored completions
(`data.scored_pairs`), the batch sampler that keeps a prompt's pairs in one batch and the groups of a batch
(`packing.prompt_groups`). Hand-computed pairs on tiny in-memory datasets; the sampler's promises (every pair once per
epoch, TRL's batch sizes, groups kept whole where they fit, seeded) checked over seeds, epochs and awkward sizes."""

import math
import random
import re

import pytest
from accelerate.data_loader import BatchSamplerShard
from datasets import Dataset, DatasetDict

from trl_padfree.data.scored_pairs import pair_scored_completions, pair_ultrafeedback
from trl_padfree.packing.prompt_groups import PromptGroupBatchSampler, pack_prompt_groups, prompt_groups
from trl_padfree.packing.units import PairUnits

# ---- pairs from scored completions ----


def scored(prompts, completions, scores, **columns):
    return Dataset.from_dict({"prompt": prompts, "completions": completions, "scores": scores, **columns})


def pairs_of(dataset):
    return [
        (row["prompt_id"], row["chosen"], row["rejected"], row["score_chosen"], row["score_rejected"])
        for row in dataset
    ]


def test_best_vs_worst_pairs_each_prompt_s_highest_with_its_lowest():
    dataset = scored(["2+2=", "Hi"], [["5", "4", "22", "8"], ["hello", "yo"]], [[3, 9, 1, 5], [0.5, 2]])
    pairs = pair_scored_completions(dataset)
    assert pairs.column_names == ["prompt", "chosen", "rejected", "prompt_id", "score_chosen", "score_rejected"]
    assert pairs["prompt"][:] == ["2+2=", "Hi"]
    assert pairs_of(pairs) == [(0, "4", "22", 9.0, 1.0), (1, "yo", "hello", 2.0, 0.5)]


def test_all_pairs_of_four_distinct_scores_are_six_best_first_and_together():
    dataset = scored(["a", "b"], [["w", "x", "y", "z"], ["p", "q"]], [[2, 4, 1, 3], [1, 0]])
    pairs = pair_scored_completions(dataset, "all_pairs")
    # ranked x(4) z(3) w(2) y(1): each completion against every worse one
    expected = [("x", "z"), ("x", "w"), ("x", "y"), ("z", "w"), ("z", "y"), ("w", "y")]
    assert [(chosen, rejected) for _, chosen, rejected, *_ in pairs_of(pairs)][:6] == expected
    assert pairs["prompt_id"][:] == [0] * 6 + [1]
    assert all(row["score_chosen"] > row["score_rejected"] for row in pairs)


def test_equal_scores_make_no_pair():
    dataset = scored(
        ["a", "b", "c"], [["w", "x", "y", "z"], ["p", "q", "r"], ["s", "t"]], [[5, 5, 3, 3], [2] * 3, [1, 0]]
    )
    all_pairs = pair_scored_completions(dataset, "all_pairs")
    assert [(p, c, r) for p, c, r, *_ in pairs_of(all_pairs)] == [
        (0, "w", "y"), (0, "w", "z"), (0, "x", "y"), (0, "x", "z"), (2, "s", "t")
    ]  # fmt: skip
    best = pair_scored_completions(dataset, "best_vs_worst")  # the first of equals on either side
    assert [(p, c, r) for p, c, r, *_ in pairs_of(best)] == [(0, "w", "y"), (2, "s", "t")]


def test_conversational_prompts_and_completions_are_copied_as_they_are():
    def says(role, text):
        return [{"role": role, "content": text}]

    dataset = scored(
        [says("user", "Color of the sky?")],
        [[says("assistant", "Blue."), says("assistant", "Green."), says("assistant", "Grey.")]],
        [[9.0, 1.0, 4.0]],
    )
    pairs = pair_scored_completions(dataset, "all_pairs")
    assert len(pairs) == 3
    assert pairs[0]["prompt"] == says("user", "Color of the sky?")
    assert (pairs[0]["chosen"], pairs[0]["rejected"]) == (says("assistant", "Blue."), says("assistant", "Grey."))
    assert (pairs[2]["chosen"], pairs[2]["rejected"]) == (says("assistant", "Grey."), says("assistant", "Green."))


def test_column_names_an_id_column_and_other_columns():
    dataset = Dataset.from_dict(
        {"question": ["q0", "q1"], "answers": [["a", "b"], ["c", "d"]], "rewards": [[0, 1], [1, 0]]}
        | {"uid": ["x17", "y3"], "source": ["math", "chat"]}
    )
    pairs = pair_scored_completions(
        dataset,
        prompt_column="question",
        completions_column="answers",
        scores_column="rewards",
        prompt_id_column="uid",
    )
    assert pairs[:] == {
        "prompt": ["q0", "q1"], "chosen": ["b", "c"], "rejected": ["a", "d"], "prompt_id": ["x17", "y3"],
        "score_chosen": [1.0, 1.0], "score_rejected": [0.0, 0.0], "source": ["math", "chat"],
    }  # fmt: skip
    # A column named prompt_id is the id when said so
    renamed = dataset.rename_columns({"uid": "prompt_id"})
    kept = pair_scored_completions(
        renamed,
        prompt_column="question",
        completions_column="answers",
        scores_column="rewards",
        prompt_id_column="prompt_id",
    )
    assert kept["prompt_id"][:] == ["x17", "y3"]


def test_a_dataset_dict_is_paired_split_by_split():
    train = scored(["a", "b"], [["x", "y"], ["x", "y", "z"]], [[1, 2], [3, 2, 1]])
    test = scored(["c"], [["x", "y"]], [[0, -1]])
    pairs = pair_scored_completions(DatasetDict({"train": train, "test": test}), "all_pairs")
    assert isinstance(pairs, DatasetDict) and set(pairs) == {"train", "test"}
    assert pairs["train"]["prompt_id"][:] == [0, 1, 1, 1]
    assert pairs_of(pairs["test"]) == [(0, "x", "y", 0.0, -1.0)]  # ids count rows of their split


def test_several_processes_give_the_same_pairs_and_row_ids():
    random.seed(3)
    rows = 9
    dataset = scored(
        [f"p{row}" for row in range(rows)],
        [[f"c{row}.{k}" for k in range(4)] for row in range(rows)],
        [[random.randint(0, 3) for _ in range(4)] for _ in range(rows)],
    )
    assert pairs_of(pair_scored_completions(dataset, "all_pairs", num_proc=2)) == pairs_of(
        pair_scored_completions(dataset, "all_pairs")
    )


def test_ultrafeedback_as_published():
    def rated(response, score):
        return {"model": "m", "response": response, "overall_score": score, "principle": "helpfulness"}

    dataset = Dataset.from_dict(
        {
            "source": ["evol", "flan"],
            "instruction": ["Name a prime.", "2+2="],
            "models": [["m"] * 4, ["m"] * 2],
            "completions": [
                [rated("7", 8.5), rated("9", 2.0), rated("4", 2.0), rated("2", 7.0)],
                [rated("4", 9.0), rated("5", 1.5)],
            ],
        }
    )
    pairs = pair_ultrafeedback(dataset, "all_pairs")
    assert set(pairs.column_names) == {
        "prompt",
        "chosen",
        "rejected",
        "prompt_id",
        "score_chosen",
        "score_rejected",
    } | {
        "source",
        "models",
    }
    assert [(p, c, r) for p, c, r, *_ in pairs_of(pairs)] == [
        (0, "7", "2"), (0, "7", "9"), (0, "7", "4"), (0, "2", "9"), (0, "2", "4"), (1, "4", "5")
    ]  # fmt: skip
    assert pairs["prompt"][:2] == ["Name a prime."] * 2 and pairs["source"][-1] == "flan"
    assert pairs_of(pair_ultrafeedback(dataset))[0] == (0, "7", "9", 8.5, 2.0)


@pytest.mark.parametrize(
    "completions, scores, message",
    [
        ([["x"]], [[1]], "row 1: 1 completion(s); a pair needs at least 2"),
        ([["x", "y", "z"]], [[1, 2]], "row 1: 3 completions but 2 scores"),
        ([["x", "y"]], [[1, float("nan")]], "row 1: score nan is not a finite number"),
        ([["x", "y"]], [[float("inf"), 1]], "row 1: score inf is not a finite number"),
        ([["x", "y"]], [[None, 1]], "row 1: score None is not a finite number"),
    ],
)
def test_bad_rows_are_refused_by_their_row(completions, scores, message):
    dataset = scored(["fine", "bad"], [["a", "b"], *completions], [[1, 0], *scores])
    with pytest.raises(ValueError, match=re.escape(f"the dataset, {message}")):
        pair_scored_completions(dataset)
    with pytest.raises(ValueError, match="row 0: 'completions' and 'scores' must be lists, got str"):
        pair_scored_completions(scored(["a"], ["xy"], [[1, 2]]))  # a string would pair its characters


def test_bad_arguments_and_columns_are_refused():
    dataset = scored(["a"], [["x", "y"]], [[1, 0]])
    with pytest.raises(ValueError, match="pairing='best_vs_rest' is not one of"):
        pair_scored_completions(dataset, "best_vs_rest")
    with pytest.raises(ValueError, match="has no column 'rewards'"):
        pair_scored_completions(dataset, scores_column="rewards")
    with pytest.raises(ValueError, match="'prompt_id' would be overwritten.*prompt_id_column='prompt_id'"):
        pair_scored_completions(dataset.add_column("prompt_id", [7]))
    with pytest.raises(ValueError, match="'chosen' would be overwritten"):
        pair_scored_completions(dataset.add_column("chosen", ["x"]))
    with pytest.raises(ValueError, match="makes no pair"):
        pair_scored_completions(scored(["a"], [["x", "y"]], [[1, 1]]))
    with pytest.raises(ValueError, match="split 'test', row 0: 1 completion"):
        pair_scored_completions(DatasetDict({"train": dataset, "test": scored(["b"], [["x"]], [[1]])}))
    with pytest.raises(TypeError, match="Dataset or DatasetDict, got list"):
        pair_scored_completions([{"prompt": "a", "completions": ["x", "y"], "scores": [1, 0]}])


# ---- the sampler ----


def random_groups(seed: int, count: int, largest: int) -> list[int]:
    """Group ids of pairs in dataset order, as pairing writes them: a prompt's pairs next to each other."""
    rng = random.Random(seed)
    ids = []
    for prompt in range(count):
        ids += [prompt] * rng.randint(1, largest)
    return ids


def batches_of(ids, batch_size, epochs=(0,), **options):
    sampler = PromptGroupBatchSampler(PairUnits.by_group_id(ids), batch_size, **options)
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out.append(list(sampler))
        assert len(out[-1]) == len(sampler)
    return out


def pieces(ids, batches) -> dict:
    """How many batches each group's pairs are spread over."""
    spread = {}
    for batch in batches:
        for group in {ids[index] for index in batch}:
            spread[group] = spread.get(group, 0) + 1
    return spread


@pytest.mark.parametrize("batch_size", [1, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 42])
def test_every_pair_once_per_epoch_in_batches_of_the_batch_size(seed, batch_size):
    ids = random_groups(seed, 23, 7)
    for batches in batches_of(ids, batch_size, epochs=(0, 1, 2), seed=seed):
        assert sorted(index for batch in batches for index in batch) == list(range(len(ids)))
        assert [len(batch) for batch in batches[:-1]] == [batch_size] * (len(batches) - 1)
        assert len(batches[-1]) == len(ids) % batch_size or batch_size
        assert len(batches) == math.ceil(len(ids) / batch_size)


@pytest.mark.parametrize("batch_size", [3, 5, 8])
def test_drop_last_drops_only_a_short_last_batch(batch_size):
    ids = random_groups(5, 17, 6)
    for batches in batches_of(ids, batch_size, epochs=(0, 1), seed=5, drop_last=True):
        indices = [index for batch in batches for index in batch]
        assert len(indices) == len(set(indices)) == len(ids) // batch_size * batch_size
        assert {len(batch) for batch in batches} == {batch_size}


@pytest.mark.parametrize(
    "sizes, batch_size",
    [
        ([6] * 10, 6),  # all_pairs of K = 4 for every prompt
        ([6] * 9, 12),
        ([1] * 7, 3),  # one pair per prompt: plain batches
        ([4, 1, 2, 1, 4, 2, 2, 1, 4, 4, 1], 4),  # sizes dividing each other and the batch
        ([8, 16, 2, 4, 4, 2, 8, 1], 8),  # and groups of whole batches
    ],
)
def test_groups_are_never_split_where_their_sizes_divide_the_batch(sizes, batch_size):
    ids = [group for group, size in enumerate(sizes) for _ in range(size)]
    for seed in (0, 1, 2):
        for batches in batches_of(ids, batch_size, epochs=(0, 1, 2), seed=seed):
            spread = pieces(ids, batches)
            assert all(spread[group] == max(1, size // batch_size) for group, size in enumerate(sizes)), spread


@pytest.mark.parametrize("batch_size", [2, 4, 8, 16])
@pytest.mark.parametrize("seed", [0, 7])
def test_each_batch_boundary_splits_at_most_one_group(seed, batch_size):
    # A group that fits is in at most 2 batches, a larger one in its whole batches and at most 2 more; the prompt
    # segments are at most one more per batch boundary than whole packing would give
    ids = random_groups(seed, 40, 12)
    for batches in batches_of(ids, batch_size, epochs=(0, 1), seed=seed):
        spread, sizes = pieces(ids, batches), {group: ids.count(group) for group in set(ids)}
        assert all(
            spread[group] <= sizes[group] // batch_size + (2 if sizes[group] % batch_size else 1) for group in sizes
        )
        whole = sum(math.ceil(size / batch_size) for size in sizes.values())
        assert sum(spread.values()) <= whole + len(batches) - 1


def test_the_hand_packed_example_of_the_module():
    ids = ["a"] * 3 + ["b"] + ["c"] * 2 + ["d"] * 6 + ["e"] * 2
    groups = [[6, 7, 8, 9, 10, 11], [0, 1, 2], [12, 13], [4, 5], [3]]  # d a e c b, shuffled as drawn
    assert pack_prompt_groups(groups, 4) == ([[6, 7, 8, 9], [0, 1, 2, 3], [10, 11, 12, 13]], [4, 5])
    # groups of 3 in batches of 4: the short bins are handed back whole, for the sampler to cut
    assert pack_prompt_groups([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], 4) == ([], list(range(12)))
    batches = batches_of(ids, 4, shuffle=False)[0]
    assert sorted(map(sorted, batches[:-1])) == [[0, 1, 2, 3], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert batches[-1] == [12, 13]


def test_the_same_seed_and_epoch_give_the_same_batches_and_others_differ():
    ids = random_groups(11, 30, 6)
    first, second = batches_of(ids, 4, epochs=(0, 1), seed=3)
    assert batches_of(ids, 4, epochs=(0, 1), seed=3) == [first, second]
    sampler = PromptGroupBatchSampler(PairUnits.by_group_id(ids), 4, seed=3)
    assert list(sampler) == list(sampler) == first  # iterating again, the same epoch
    assert second != first
    assert batches_of(ids, 4, seed=4)[0] != first
    unshuffled = batches_of(ids, 4, epochs=(0, 5), seed=3, shuffle=False)
    assert unshuffled[0] == unshuffled[1] == batches_of(ids, 4, seed=9, shuffle=False)[0]


def test_awkward_sizes():
    # Groups of one: plain batches of the shuffled pairs
    batches = batches_of(list(range(10)), 4, seed=1)[0]
    assert [len(batch) for batch in batches] == [4, 4, 2] and sorted(sum(batches, [])) == list(range(10))
    # batch_size 1: one pair a batch, every pair once
    batches = batches_of(random_groups(2, 5, 4), 1, seed=2)[0]
    assert all(len(batch) == 1 for batch in batches) and sorted(b[0] for b in batches) == list(range(len(batches)))
    # One group larger than the batch: its whole batches, then the rest
    assert batches_of(["p"] * 10, 4, shuffle=False)[0] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches_of(["p"] * 10, 4, drop_last=True, shuffle=False)[0] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # A single pair; fewer pairs than a batch
    assert batches_of(["p"], 8)[0] == [[0]]
    assert batches_of(["p"], 8, drop_last=True)[0] == []
    # Tokenized prompts as group ids (lists): pairs with the same tokens are one group
    assert batches_of([[5, 6], [7], [5, 6], [7]], 2, shuffle=False)[0] == [[0, 2], [1, 3]]


def test_bad_sampler_arguments_are_refused():
    for batch_size in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            PromptGroupBatchSampler(PairUnits.by_group_id([0, 1]), batch_size)
    with pytest.raises(ValueError, match="got no pairs"):
        PromptGroupBatchSampler(PairUnits.by_group_id([]), 2)
    with pytest.raises(ValueError, match=r"group id of pair 1 \(\{'a': 1\}\)"):
        PromptGroupBatchSampler(PairUnits.by_group_id([0, {"a": 1}]), 2)


def test_accelerate_deals_the_batches_whole_to_each_process():
    # Each process runs whole batches of the sampler: a group kept in a batch is kept on one process
    ids = [group for group in range(7) for _ in range(6)]  # 42 pairs, 7 batches of 6
    sampler = PromptGroupBatchSampler(PairUnits.by_group_id(ids), 6, seed=0)
    batches = list(sampler)
    dealt = [list(BatchSamplerShard(sampler, num_processes=2, process_index=rank)) for rank in range(2)]
    assert dealt[0] == batches[0::2] and dealt[1][:3] == batches[1::2]
    assert dealt[1][3] == batches[0]  # accelerate's even batches: the last round filled up with the first batch


def test_pairs_of_k_completions_batch_one_prompt_at_a_time():
    # K = 4 all ways: 6 pairs per prompt, 6 pairs a batch: each batch one prompt, its prompt computed once
    rng = random.Random(0)
    dataset = scored(
        [f"prompt {row}" for row in range(5)],
        [[f"answer {row}.{k}" for k in range(4)] for row in range(5)],
        [rng.sample(range(10), 4) for _ in range(5)],
    )
    pairs = pair_scored_completions(dataset, "all_pairs")
    for batch in PromptGroupBatchSampler(PairUnits.by_group_id(pairs["prompt_id"][:]), 6, seed=1):
        assert len(batch) == 6 and len({pairs[index]["prompt"] for index in batch}) == 1
        assert prompt_groups([[ord(c) for c in pairs[index]["prompt"]] for index in batch]) == [list(range(6))]


# ---- the groups of a batch ----


def test_prompt_groups_of_a_batch():
    assert prompt_groups([]) == []
    assert prompt_groups([[1]]) == [[0]]
    assert prompt_groups([[3, 4], [3], [3, 4], [3, 4, 5], [3]]) == [[0, 2], [1, 4], [3]]
    assert prompt_groups([[3, 4], [3, 4], [3, 4]], keys=["img0", "img1", "img0"]) == [[0, 2], [1]]
    with pytest.raises(ValueError, match="2 keys for 3 prompts"):
        prompt_groups([[1], [1], [1]], keys=["a", "b"])
