"""Rollout rows and packing: the action mask covers every generated token up to and including the
first EOS and nothing after; per-action values land on the action positions of any packing."""

import torch

from utils.math.rows import Row, from_token_layout, pack, split_generation, to_token_layout

PAD, EOS = 0, 9


def test_split_generation_cuts_at_first_eos_and_strips_padding():
    prompt_ids = torch.tensor([[PAD, PAD, 5, 6], [1, 2, 3, 4]])
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    sequences = torch.cat([prompt_ids, torch.tensor([[7, EOS, PAD, PAD], [7, 8, 7, 8]])], dim=1)
    rows = split_generation(sequences, prompt_ids, prompt_mask, EOS)
    assert rows[0].prompt_ids.tolist() == [5, 6] and rows[0].response_ids.tolist() == [7, EOS]
    assert rows[0].ended_with_eos
    assert rows[1].prompt_ids.tolist() == [1, 2, 3, 4] and rows[1].response_ids.tolist() == [7, 8, 7, 8]
    assert not rows[1].ended_with_eos  # truncated by the length limit: every token is an action


def test_tokens_after_eos_are_never_actions_even_if_they_are_eos_again():
    prompt_ids, prompt_mask = torch.tensor([[3]]), torch.tensor([[1]])
    rows = split_generation(torch.tensor([[3, EOS, EOS, 4]]), prompt_ids, prompt_mask, EOS)
    assert rows[0].response_ids.tolist() == [EOS]


def test_pack_layout_by_hand():
    rows = [
        Row(torch.tensor([5, 6]), torch.tensor([7, EOS]), True),
        Row(torch.tensor([1, 2, 3]), torch.tensor([4]), False),
    ]
    batch = pack(rows, PAD)
    assert batch["prompt_len"] == 3
    assert batch["input_ids"].tolist() == [[PAD, 5, 6, 7, EOS], [1, 2, 3, 4, PAD]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # position i of the action mask is about token i+1: row 0's actions are tokens 3 (7) and 4 (EOS)
    assert batch["action_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]


def test_per_action_values_round_trip_through_any_packing():
    rows = [
        Row(torch.tensor([5, 6]), torch.tensor([7, EOS]), True, per_action={"v": torch.tensor([0.5, 1.5])}),
        Row(
            torch.tensor([1, 2, 3, 4, 5]),
            torch.tensor([4, 4, 4]),
            False,
            per_action={"v": torch.tensor([1.0, 2.0, 3.0])},
        ),
    ]
    for subset in ([rows[0]], [rows[1]], rows):
        batch = pack(subset, PAD)
        length = batch["input_ids"].shape[1]
        layout = to_token_layout(subset, "v", batch["prompt_len"], length)
        assert torch.equal(layout != 0, batch["action_mask"] != 0)
        copies = [Row(r.prompt_ids, r.response_ids, r.ended_with_eos) for r in subset]
        from_token_layout(copies, "v", layout, batch["prompt_len"])
        for original, copy in zip(subset, copies):
            assert torch.equal(original.per_action["v"], copy.per_action["v"])
