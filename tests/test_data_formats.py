"""Row formats (utils/data/formats.py): every accepted layout from its fixture in tests/fixtures/formats,
and each malformed row's error naming file:line and the field."""

import json
import os

import pytest

from utils import data as D
from utils.data import DataError, RowFormat

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "formats")


def fixture(name):
    return os.path.join(FIXTURES, name)


def rows_of(name, step, fmt=D.DEFAULT_FORMAT):
    return D.read_rows(fixture(name), step, fmt)[0]


def write(tmp_path, rows, name="x.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def u(c):
    return {"role": "user", "content": c}


def a(c):
    return {"role": "assistant", "content": c}


# --------------------------------------------------------------------------- 1. standard
def test_standard_rows_stay_raw_strings():
    r = rows_of("standard.jsonl", 2)[0]
    assert (r["prompt"], r["chosen"], r["rejected"]) == ("Human: Name a colour.\n\nAssistant:", " Blue.", " Seven.")
    assert r["messages"] is None and r["origin"].endswith("standard.jsonl:1")


def test_response_and_completion_are_synonyms_of_chosen():
    got = rows_of("prompt_completion.jsonl", 1)
    assert [(r["prompt"], r["chosen"]) for r in got] == [("Name a colour.", " Blue."), ("Say hello.", " Hello!")]


def test_apply_chat_template_makes_string_rows_two_turns():
    r = rows_of("standard.jsonl", 2, RowFormat(apply_chat_template=True))[0]
    # a Human/Assistant prompt becomes its own turns, not one user turn holding "Human: ..."
    assert r["prompt"] == [u("Name a colour.")]
    assert r["chosen"] == [a("Blue.")] and r["rejected"] == [a("Seven.")]
    r = rows_of("prompt_completion.jsonl", 1, RowFormat(apply_chat_template=True))[0]
    assert r["messages"] == [u("Name a colour."), a(" Blue.")]


# --------------------------------------------------------------------------- 2. conversational SFT
def test_messages_rows_for_sft_and_as_step3_prompts():
    got = rows_of("messages.jsonl", 1)
    assert len(got) == 3 and got[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert len(got[0]["messages"]) == 5 and got[0]["prompt"] is None
    # step 3: every turn before the last assistant turn
    prompts = rows_of("messages.jsonl", 3)
    assert prompts[0]["prompt"] == got[0]["messages"][:4] and prompts[1]["prompt"] == [u("Say hello.")]


def test_messages_row_refused_by_step2_naming_the_fields(tmp_path):
    with pytest.raises(DataError, match=r"messages\.jsonl:1: a 'messages' row has no rejected side"):
        rows_of("messages.jsonl", 2)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"messages": "hi"}, r"x\.jsonl:1: field 'messages' must be a list of messages, got str"),
        ({"messages": [u("q"), "a"]}, r"x\.jsonl:1: field 'messages'\[1\]: expected a message object"),
        (
            {"messages": [u("q"), {"role": "bot", "content": "a"}]},
            r"x\.jsonl:1: field 'messages'\[1\]: 'role' must be one of",
        ),
        (
            {"messages": [u("q"), {"role": "assistant", "content": ["a"]}]},
            r"x\.jsonl:1: field 'messages'\[1\]: 'content' must be a string, got list",
        ),
        (
            {"messages": [u("q"), {"role": "assistant"}]},
            r"x\.jsonl:1: field 'messages'\[1\]: 'content' must be a string",
        ),
    ],
)
def test_malformed_messages_name_file_line_and_field(tmp_path, bad, message):
    with pytest.raises(DataError, match=message):
        D.read_rows(write(tmp_path, [bad]), 1)


def test_skips_counted_per_reason_and_logged_once_per_source(tmp_path):
    rows = [
        {"messages": [u("q"), a("fine")]},
        {"messages": [u("q"), a("  ")]},
        {"messages": [u("only a question")]},
        {"messages": []},
        {"messages": [u("q"), a("fine again")]},
    ]
    p = write(tmp_path, rows)
    logged = []
    res = D.build_step_rows([p], "1,0,0", 1, 0, eval_fraction=0, log=logged.append)
    assert len(res.train) == 2
    assert res.stats["skipped"] == {"empty_turn": 1, "no_assistant_turn": 1, "empty": 1}
    assert res.stats["sources"][p]["skipped"] == res.stats["skipped"]
    assert [line for line in logged if p in line] == [
        f"[data] {p}: skipped 3 of this step's rows (empty 1, empty_turn 1, no_assistant_turn 1)"
    ]


# --------------------------------------------------------------------------- 3. conversational preference
def test_conversational_pairs_trl_layout():
    got = rows_of("conversational_pairs.jsonl", 2)
    assert got[0]["prompt"] == [u("Name a colour.")] and got[0]["chosen"] == [a("Blue.")]
    assert got[1]["prompt"][0]["role"] == "system" and got[1]["rejected"] == [a("No.")]
    # step 1 trains prompt + chosen as one conversation
    assert rows_of("conversational_pairs.jsonl", 1)[0]["messages"] == [u("Name a colour."), a("Blue.")]


def test_implicit_prompt_pairs_share_their_prefix_else_skipped():
    logged = []
    res = D.build_step_rows([fixture("implicit_prompt_pairs.jsonl")], "0,1,0", 2, 0, eval_fraction=0, log=logged.append)
    assert len(res.train) == 1 and res.stats["skipped"] == {"prefix_mismatch": 1}
    r = res.train[0]
    assert r["prompt"] == [u("Name a colour.")] and r["chosen"] == [a("Blue.")] and r["rejected"] == [a("Seven.")]
    assert any("prefix_mismatch 1" in line for line in logged)


def test_chosen_list_must_hold_assistant_messages_when_a_prompt_is_given(tmp_path):
    p = write(tmp_path, [{"prompt": [u("q")], "chosen": [u("not an answer")], "rejected": [a("x")]}])
    with pytest.raises(DataError, match=r"x\.jsonl:1: field 'chosen'\[0\]: expected an assistant message"):
        D.read_rows(p, 2)


def test_mixed_strings_and_message_lists_refused(tmp_path):
    p = write(tmp_path, [{"prompt": "q", "chosen": [a("x")], "rejected": [a("y")]}])
    with pytest.raises(DataError, match=r"x\.jsonl:1: fields \['prompt', 'chosen', 'rejected'\] mix strings"):
        D.read_rows(p, 2)


# --------------------------------------------------------------------------- 4. HH-RLHF
def test_hh_rlhf_prompt_is_the_shared_text_up_to_the_last_assistant_marker():
    res = D.build_step_rows([fixture("hh_rlhf.jsonl")], "0,1,0", 2, 0, eval_fraction=0, log=lambda s: None)
    assert res.stats["skipped"] == {"prefix_mismatch": 1}  # row 2: the two sides differ in the first turn
    by_origin = {r["origin"].rsplit(":", 1)[1]: r for r in res.train}
    r = by_origin["1"]
    assert r["prompt"] == "\n\nHuman: What is 2+2?\n\nAssistant: 4.\n\nHuman: And 3+3?\n\nAssistant:"
    assert (r["chosen"], r["rejected"]) == (" 6.", " No idea.")
    # with --apply_chat_template the transcript becomes its turns
    r = [r for r in rows_of("hh_rlhf.jsonl", 2, RowFormat(apply_chat_template=True)) if r["origin"].endswith(":1")][0]
    assert r["prompt"] == [u("What is 2+2?"), a("4."), u("And 3+3?")] and r["chosen"] == [a("6.")]


def test_hh_rlhf_for_sft_and_step3():
    # steps 1 and 3 take the prompt from chosen alone: row 2's differing sides do not matter there
    assert [r["chosen"] for r in rows_of("hh_rlhf.jsonl", 1)] == [" 6.", " Hello!", " Blue."]
    prompts = rows_of("hh_rlhf.jsonl", 3)
    assert prompts[0]["prompt"].endswith("And 3+3?\n\nAssistant:") and len(prompts) == 3


def test_string_pair_without_prompt_or_transcript_names_the_missing_prompt(tmp_path):
    p = write(tmp_path, [{"chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match=r"x\.jsonl:1: missing field 'prompt' \(or 'messages', or HH-RLHF"):
        D.read_rows(p, 2)


# --------------------------------------------------------------------------- 5. prompt-only rows keep fields
def test_step3_prompts_keep_every_other_field():
    got = rows_of("prompts_with_fields.jsonl", 3)
    assert got[0]["prompt"] == "What is 2+2?" and got[0]["extra"] == {"answer": "4", "label": 1}
    assert got[1]["prompt"] == [u("What is 3+3?")] and got[1]["extra"] == {"answer": "6", "label": 0}
    assert got[2]["prompt"] == [u("What is 1+1?")] and got[2]["extra"] == {"answer": "2"}


def test_prompt_extras_reach_the_tokenised_examples(tiny_gpt2):
    from utils.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_gpt2)
    examples, _ = D.tokenize_prompts(rows_of("prompts_with_fields.jsonl", 3)[:1], tok, 64)
    assert examples[0]["extra"] == {"answer": "4", "label": 1}


# --------------------------------------------------------------------------- 6. key mapping
def test_key_mapping_flags(tmp_path):
    fmt = RowFormat(prompt_key="question", chosen_key="good", rejected_key="bad")
    r = rows_of("mapped_keys.jsonl", 2, fmt)[0]
    assert (r["prompt"], r["chosen"], r["rejected"]) == ("Name a colour.", " Blue.", " Seven.")
    assert rows_of("conversation_keys.jsonl", 1, RowFormat(messages_key="conversation"))[0]["messages"][1] == a("Blue.")
    # a missing mapped field is named by its mapped key
    p = write(tmp_path, [{"question": "q", "bad": "b"}])
    with pytest.raises(DataError, match=r"x\.jsonl:1: missing field 'good'"):
        D.read_rows(p, 2, fmt)


def test_format_flags_parse_into_a_row_format(tmp_path):
    from step1_sft.main import parse_args

    args = parse_args(
        [
            "--model_name_or_path",
            "m",
            "--data_path",
            "d",
            "--output_dir",
            str(tmp_path / "o"),
            "--prompt_key",
            "q",
            "--messages_key",
            "conv",
            "--apply_chat_template",
            "--train_on_last_turn_only",
        ]
    )
    assert RowFormat.from_args(args) == RowFormat(prompt_key="q", messages_key="conv", apply_chat_template=True)
    assert args.train_on_last_turn_only


# --------------------------------------------------------------------------- 7. sources
def test_parquet_and_save_to_disk_sources_of_conversations(tmp_path):
    import datasets

    records = [json.loads(line) for line in open(fixture("conversational_pairs.jsonl"))]
    ds = datasets.Dataset.from_list(records)
    ds.to_parquet(str(tmp_path / "pairs.parquet"))
    got = D.read_rows(str(tmp_path / "pairs.parquet"), 2)[0]
    assert [r["chosen"] for r in got] == [x["chosen"] for x in records]
    assert got[0]["origin"].endswith("pairs.parquet:row 1")
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "saved"))
    src = D.load_source(str(tmp_path / "saved"))
    assert len(src.train) == 2 and len(src.eval) == 1
    got = D.read_rows(str(tmp_path / "saved"), 2)[0]
    assert got[0]["prompt"] == records[1]["prompt"]


# --------------------------------------------------------------------------- 8. rows a step must not train on
KTO_ROWS = [
    {"prompt": "Q?", "completion": " yes", "label": True},
    {"prompt": "Q?", "completion": " no", "label": False},
]


def one_error(call) -> str:
    with pytest.raises(DataError) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_step1_trains_a_row_labelled_true_and_refuses_one_labelled_false(tmp_path):
    p = write(tmp_path, KTO_ROWS[:1])
    assert [(r["prompt"], r["chosen"]) for r in D.read_rows(p, 1)[0]] == [("Q?", " yes")]
    p = write(tmp_path, KTO_ROWS)
    assert one_error(lambda: D.build_step_rows([p], "1,0,0", 1, 0, eval_fraction=0, log=lambda s: None)) == (
        f"{p}:2: a row labelled undesirable ('label': false) is not an SFT example; drop it or train it with "
        "step2_dpo --loss_type kto"
    )


@pytest.mark.parametrize(
    "name, text, line",
    [
        ("kto.csv", "prompt,completion,label\nQ?,yes,true\nQ?,no,FALSE\n", 3),  # CSV's text false
        (
            "chat.jsonl",
            json.dumps({"prompt": [u("Q?")], "completion": [a("no")], "label": False}) + "\n",
            1,
        ),  # TRL's conversational KTO row
    ],
)
def test_step1_refuses_false_labels_in_every_form(tmp_path, name, text, line):
    p = tmp_path / name
    p.write_text(text)
    assert one_error(lambda: D.read_rows(str(p), 1)) == (
        f"{p}:{line}: a row labelled undesirable ('label': false) is not an SFT example; drop it or train it "
        "with step2_dpo --loss_type kto"
    )


@pytest.mark.parametrize(
    "step, fmt",
    [(1, RowFormat()), (2, RowFormat()), (2, RowFormat(unpaired=True)), (3, RowFormat())],
    ids=["sft", "reward model", "kto", "ppo prompts"],
)
def test_a_file_mixing_pairs_and_unpaired_rows_is_refused_in_every_step(tmp_path, step, fmt):
    rows = [{"prompt": "Q?", "completion": " a"}, {"prompt": "Q?", "chosen": " a", "rejected": " b"}] + KTO_ROWS
    p = write(tmp_path, rows)
    split = {1: "1,0,0", 2: "0,1,0", 3: "0,0,1"}[step]

    def build():
        return D.build_step_rows([p], split, step, 0, eval_fraction=0, log=lambda s: None, fmt=fmt)

    assert one_error(build) == (
        f"{p}: mixes preference pairs ('chosen' and 'rejected', first at {p}:2) and unpaired feedback rows "
        f"('label' true/false and no 'rejected', first at {p}:3); give each kind a file of its own "
        "(step2_dpo --loss_type kto reads both)"
    )


def test_pairs_and_unpaired_rows_in_files_of_their_own_are_read(tmp_path):
    folder = tmp_path / "feedback"
    folder.mkdir()
    write(folder, KTO_ROWS, "train.jsonl")
    write(folder, [{"prompt": "Q?", "chosen": " a", "rejected": " b"}], "eval.jsonl")
    src = D.load_source(str(folder))
    assert len(src.train) == 2 and len(src.eval) == 1
    # a renamed label field is what load_source's format names
    mixed = write(
        tmp_path, [{"prompt": "Q?", "chosen": " a", "rejected": " b"}, {"prompt": "Q?", "chosen": " c", "ok": 1}]
    )
    assert len(D.load_source(mixed).train) == 2
    fmt = RowFormat(label_key="ok")
    assert len(D.load_source(mixed, fmt).train) == 2  # 1 is not a true/false label
    mixed = write(
        tmp_path, [{"prompt": "Q?", "chosen": " a", "rejected": " b"}, {"prompt": "Q?", "chosen": " c", "ok": True}]
    )
    assert "unpaired feedback rows ('ok' true/false" in one_error(lambda: D.load_source(mixed, fmt))
    # and the steps pass their format on
    build = lambda: D.build_step_rows([mixed], "0,1,0", 2, 0, eval_fraction=0, log=lambda s: None, fmt=fmt)  # noqa: E731
    assert "unpaired feedback rows ('ok' true/false" in one_error(build)
    assert "unpaired feedback rows ('ok' true/false" in one_error(lambda: D.read_rows(mixed, 2, fmt=fmt))


@pytest.mark.parametrize(
    "fmt, field",
    [(RowFormat(unpaired=True), "label"), (RowFormat(unpaired=True, label_key="thumbs"), "thumbs")],
)
def test_an_unpaired_row_without_its_label_names_the_label_for_kto(tmp_path, fmt, field):
    p = write(tmp_path, [{"prompt": "Q?", "completion": " yes"}])
    assert one_error(lambda: D.read_rows(p, 2, fmt)) == (
        f"{p}:1: missing field '{field}' (unpaired feedback for --loss_type kto needs true/false; a preference "
        "pair needs 'rejected')"
    )
    # the reward model and DPO's pair losses still name the rejected side
    assert one_error(lambda: D.read_rows(p, 2)) == f"{p}:1: missing field 'rejected'"
