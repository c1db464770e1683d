"""Chat templates (utils/data/chat.py, tokenize.py): templated ids equal apply_chat_template's, SFT labels
cover exactly the assistant turns and their end-of-turn tokens, truncation keeps the template's frame,
responses end at the end-of-turn token. On the real SmolLM2 tokenizer and on a tiny ChatML tokenizer
whose end-of-turn token is not EOS."""

import pytest
import torch

from utils import data as D
from utils.data import IGNORE_INDEX, DataError, RowFormat
from utils.math.rows import split_generation


def u(c):
    return {"role": "user", "content": c}


def a(c):
    return {"role": "assistant", "content": c}


@pytest.fixture(scope="module")
def tiny_chat_tokenizer(tiny_chat_llama):
    from utils.models.loading import load_tokenizer

    return load_tokenizer(tiny_chat_llama)


@pytest.fixture(params=["smollm2", "tiny_chatml"])
def tok(request, smollm2_tokenizer, tiny_chat_tokenizer):
    return smollm2_tokenizer if request.param == "smollm2" else tiny_chat_tokenizer


def template_ids(tok, messages, **kw):
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


def sft_row(messages):
    return D.normalize_row({"messages": messages}, "x.jsonl:1", 1)


REPEATED = [
    {"role": "system", "content": "Be brief."},
    u("Say yes."),
    a("yes."),
    u("Say yes."),
    a("yes."),
    u("Say no."),
    a("no."),
]


def labelled_spans(example):
    """Runs of labelled positions as (start, end)."""
    spans, start = [], None
    for i, label in enumerate(example["labels"] + [IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_end_of_turn_tokens(smollm2_tokenizer, tiny_chat_tokenizer):
    # SmolLM2: <|im_end|> is EOS; the tiny ChatML tokenizer ends turns with <|im_end|> but EOS is <|endoftext|>
    assert D.stop_token_ids(smollm2_tokenizer, chat=True) == [smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    eot = tiny_chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert D.stop_token_ids(tiny_chat_tokenizer, chat=True) == [tiny_chat_tokenizer.eos_token_id, eot]
    assert D.stop_token_ids(tiny_chat_tokenizer, chat=False) == [tiny_chat_tokenizer.eos_token_id]


def test_sft_ids_are_the_templates_and_labels_cover_each_assistant_turn_and_its_end_of_turn(tok):
    (ex,), stats = D.tokenize_sft([sft_row(REPEATED)], tok, 512)
    assert ex["input_ids"] == template_ids(tok, REPEATED)
    spans = labelled_spans(ex)
    assert len(spans) == 3  # the repeated "yes." turns are told apart, each trained once
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    for (start, end), reply in zip(spans, ["yes.", "yes.", "no."]):
        assert tok.decode(ex["input_ids"][start:end]) == reply + "<|im_end|>"
        assert ex["input_ids"][end - 1] == eot
    # every labelled token is an assistant token: the prompt of each turn ends where its labels start
    for i, (start, _) in enumerate(spans):
        turn = [j for j, m in enumerate(REPEATED) if m["role"] == "assistant"][i]
        assert start == len(template_ids(tok, REPEATED[:turn], add_generation_prompt=True))
    (last,), _ = D.tokenize_sft([sft_row(REPEATED)], tok, 512, last_turn_only=True)
    assert labelled_spans(last) == spans[-1:] and last["input_ids"] == ex["input_ids"]


def test_sft_conversation_right_truncated_or_skipped_as_too_long(tok):
    full = template_ids(tok, REPEATED)
    (ex,), stats = D.tokenize_sft([sft_row(REPEATED)], tok, len(full) - 3)
    assert ex["input_ids"] == full[: len(full) - 3] and stats["truncated_response"] == 1
    header = len(template_ids(tok, REPEATED[:2], add_generation_prompt=True))
    examples, stats = D.tokenize_sft([sft_row(REPEATED)], tok, header)
    assert examples == [] and stats["skipped"] == {"too_long": 1}


def test_pairs_end_at_the_end_of_turn_token_and_share_the_prompt(tok):
    row = D.normalize_row(
        {"prompt": [u("Name a colour.")], "chosen": [a("Blue.")], "rejected": [a("Seven.")]}, "p:1", 2
    )
    (ex,), _ = D.tokenize_pairs([row], tok, 512)
    chosen = template_ids(tok, [u("Name a colour."), a("Blue.")])
    prompt = template_ids(tok, [u("Name a colour.")], add_generation_prompt=True)
    end = chosen.index(tok.convert_tokens_to_ids("<|im_end|>"), len(prompt))
    assert ex["chosen_input_ids"] == chosen[: end + 1] != chosen  # the template's trailing newline is not scored
    assert ex["rejected_input_ids"][: len(prompt)] == prompt == ex["chosen_input_ids"][: len(prompt)]
    (dpo,), _ = D.tokenize_preference_pairs([row], tok, 512)  # DPO's: the same ids, the prompt kept apart
    assert dpo["prompt_input_ids"] == prompt and dpo["chosen_response_ids"] == chosen[len(prompt) : end + 1]
    assert prompt + dpo["rejected_response_ids"] == ex["rejected_input_ids"]


def test_step3_prompts_end_with_the_generation_prompt_and_keep_the_frame_when_truncated(tok):
    long_question = "Continue this movie review: " + "very " * 40 + "long."
    row = D.normalize_row({"prompt": [u(long_question)]}, "p:1", 3)
    full = template_ids(tok, [u(long_question)], add_generation_prompt=True)
    (ex,), stats = D.tokenize_prompts([row], tok, 512)
    assert ex["input_ids"] == full and stats["truncated_prompt"] == 0
    (cut,), stats = D.tokenize_prompts([row], tok, 40)
    text = tok.decode(cut["input_ids"])
    header = tok.decode(template_ids(tok, [u("")])[: len(template_ids(tok, [u("")])) - 2])
    assert len(cut["input_ids"]) == 40 and stats["truncated_prompt"] == 1
    assert text.startswith(header.split("user")[0]) and text.endswith("long.<|im_end|>\n<|im_start|>assistant\n")
    examples, stats = D.tokenize_prompts([row], tok, 8)  # not even the frame fits: counted, not mangled
    assert examples == [] and stats["skipped"] == {"too_long": 1}


def test_apply_chat_template_string_rows_render_like_message_rows(tok):
    fmt = RowFormat(apply_chat_template=True)
    row = D.normalize_row({"prompt": "Name a colour.", "chosen": "Blue."}, "s:1", 1, fmt)
    (ex,), _ = D.tokenize_sft([row], tok, 512)
    assert ex["input_ids"] == template_ids(tok, [u("Name a colour."), a("Blue.")])


def test_a_tokenizer_without_template_names_chat_template_flag(tiny_gpt2, tmp_path):
    from utils.models.loading import load_tokenizer

    plain = load_tokenizer(tiny_gpt2)
    with pytest.raises(DataError, match=r"x\.jsonl:1: conversational rows need a chat template .*--chat_template FILE"):
        D.tokenize_sft([sft_row([u("q"), a("r")])], plain, 64)
    # --chat_template FILE supplies one (and it is what the tokenizer saves)
    from utils.models.tiny import CHATML_TEMPLATE_FILE

    CHATML_TEMPLATE = open(CHATML_TEMPLATE_FILE).read()
    templated = load_tokenizer(tiny_gpt2, chat_template=CHATML_TEMPLATE_FILE)
    (ex,), _ = D.tokenize_sft([sft_row([u("q"), a("r")])], templated, 64)
    assert templated.decode(ex["input_ids"]).startswith("<|im_start|>system")
    templated.save_pretrained(str(tmp_path / "saved"))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "saved")).chat_template == CHATML_TEMPLATE
    for bad, message in ((tmp_path / "missing.jinja", "no such file"), (tmp_path / "x.txt", "not a Jinja template")):
        if bad.name == "x.txt":
            bad.write_text("hello")
        with pytest.raises(DataError, match=f"--chat_template .*{message}"):
            load_tokenizer(tiny_gpt2, chat_template=str(bad))


def test_generation_rows_end_at_the_first_stop_token():
    eos, eot, pad = 9, 7, 0
    prompt_ids, prompt_mask = torch.tensor([[0, 5]]), torch.tensor([[0, 1]])
    sequences = torch.tensor([[0, 5, 3, eot, 4, eos, pad]])
    (row,) = split_generation(sequences, prompt_ids, prompt_mask, [eos, eot])
    assert row.response_ids.tolist() == [3, eot] and row.ended_with_eos
    (row,) = split_generation(sequences, prompt_ids, prompt_mask, eos)
    assert row.response_ids.tolist() == [3, eot, 4, eos]


def test_evaluation_renders_message_prompts_as_training_did(tiny_chat_llama, tiny_chat_tokenizer):
    from transformers import AutoModelForCausalLM

    from utils.evaluation import generate_answers
    from utils.models.forward import GenerationSettings

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_llama).eval()
    prompts = [[u("Name a colour.")], "Human: a raw prompt\n\nAssistant:"]
    answers = generate_answers(model, tiny_chat_tokenizer, prompts, GenerationSettings(3, do_sample=False))
    assert answers[0].prompt_ids.tolist() == template_ids(tiny_chat_tokenizer, prompts[0], add_generation_prompt=True)
    assert answers[1].prompt_ids.tolist() == tiny_chat_tokenizer.encode(prompts[1], add_special_tokens=False)
