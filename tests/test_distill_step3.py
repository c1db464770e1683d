"""Step 3's on-policy distillation (step3_ppo/teachers.py): the flags and their refusals, a teacher equal to the
student giving a zero signal with the lr=0 log-ratio still ~0 (sampled and full-vocabulary signals), several teachers
routed by a data column, distillation alone (no reward), only the policy's own tokens getting a signal, and a
student moving towards its teacher."""

from __future__ import annotations

import json

import pytest
import torch

from step3_ppo.algo.distill import reverse_kl_sampled
from step3_ppo.main import parse_args, setup
from step3_ppo.teachers import Teacher, check_same_tokenizer, parse_teachers
from tests.test_step3_grpo import grpo_args, write_rows
from tests.test_step3_lr0 import prompt_batches
from utils.errors import UsageError
from utils.math.rows import Row, pack, to_token_layout
from utils.models.loading import load_tokenizer
from utils.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory) -> str:
    """A tiny llama with other random weights and the same (GPT-2) tokenizer: a teacher unlike the student."""
    return make_tiny_model("llama", str(tmp_path_factory.mktemp("teacher") / "llama"), seed=1)


def distill_args(model, tmp, *extra):
    return grpo_args(model, tmp, "--actor_zero_stage", 0, "--kl_ctl", 0, *extra)


def test_parse_teachers_names_them():
    assert parse_teachers(["/m/a"]) == [Teacher("teacher", "/m/a")]
    assert parse_teachers(["x=/m/a", "/m/b"]) == [Teacher("x", "/m/a"), Teacher("b", "/m/b")]
    with pytest.raises(UsageError, match="two teachers are called 'a'"):
        parse_teachers(["/m/a", "/n/a"])


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--distill_coef", "2"], "--distill_coef does nothing without --teacher_model_name_or_path"),
        (["--offload_teacher_model"], "--offload_teacher_model does nothing without --teacher_model_name_or_path"),
        (["TEACHER", "--distill_jsd_beta", "0.2"], "--distill_jsd_beta does nothing with --distill_signal reverse_kl"),
        (["TEACHER", "--teacher_key", "who"], "--teacher_key does nothing with one teacher"),
        (["TWO", "--distill_signal", "jsd"], "--distill_signal jsd runs the teacher in every training micro-batch"),
        (["TEACHER", "--distill_signal", "forward_kl", "--padding_free"], "leave --padding_free out"),
        (["TEACHER", "--distill_coef", "0"], "--distill_coef must be > 0, got 0"),
        (["TEACHER", "--distill_signal", "jsd", "--distill_jsd_beta", "1.5"], "--distill_jsd_beta must be in [0, 1]"),
    ],
)
def test_distillation_flags_are_checked_before_any_model_loads(tiny_llama, other_llama, tmp_path, extra, says):
    write_rows(tmp_path)
    teachers = {"TEACHER": ["--teacher_model_name_or_path", other_llama], "TWO": []}
    teachers["TWO"] = ["--teacher_model_name_or_path", f"a={tiny_llama}", f"b={other_llama}"]
    argv = [a for e in extra for a in (teachers.get(e) or [e])]
    with pytest.raises(UsageError) as info:
        parse_args(distill_args(tiny_llama, tmp_path, *argv))
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tiny_llama, tiny_chat_llama, tmp_path):
    write_rows(tmp_path)
    args = parse_args(distill_args(tiny_llama, tmp_path, "--teacher_model_name_or_path", tiny_chat_llama))
    with pytest.raises(UsageError, match=r"its tokenizer \(\d+ tokens\) differs from the actor's at .*tiny"):
        check_same_tokenizer(args, load_tokenizer(tiny_llama))
    check_same_tokenizer(
        args.__class__(**{**vars(args), "teachers": [Teacher("t", tiny_llama)]}), load_tokenizer(tiny_llama)
    )


def test_the_teacher_is_the_actors_starting_model_says_so(tiny_llama, tmp_path, capsys):
    write_rows(tmp_path)
    parse_args(distill_args(tiny_llama, tmp_path, "--teacher_model_name_or_path", tiny_llama, "--actor_lora_dim", 2))
    out = capsys.readouterr().out
    assert "is the actor's own starting model" in out and "LoRA adapters start at 0" in out


@pytest.mark.parametrize("signal", ["reverse_kl_sampled", "reverse_kl", "forward_kl", "jsd"])
def test_a_teacher_equal_to_the_student_gives_zero_and_keeps_the_lr0_log_ratio(tiny_llama, tmp_path, signal):
    """Every signal is 0 when the teacher is the student (the sampled one exactly: the same forward of the same
    weights), the advantages are the task's alone, and at lr 0 the new/old log-ratio stays ~0."""
    write_rows(tmp_path)
    argv = ["--teacher_model_name_or_path", tiny_llama, "--distill_signal", signal, "--actor_learning_rate", 0]
    run = setup(parse_args(distill_args(tiny_llama, tmp_path, *argv, "--temperature", 0.7)))
    metrics, rows = run.trainer.step(prompt_batches(run, 2, n_rows=4), step=0)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4
    assert metrics["distill/reverse_kl_sampled_token_mean"] == 0.0
    assert metrics["distill/teacher_logprob_mean"] < 0
    for row in rows:
        assert torch.equal(row.per_action["teacher_logprobs"], row.per_action["old_logprobs"])
    assert metrics["distill/top1_agreement"] == 1.0
    if signal != "reverse_kl_sampled":
        assert abs(metrics["loss/distill"]) <= 1e-6


def test_several_teachers_each_score_their_own_rows(tiny_llama, other_llama, tmp_path):
    """The data column names each row's teacher (absent: the first); a row scored by the student's own copy has
    signal 0, a row of the other teacher does not; the metrics come per teacher too."""
    path = write_rows(tmp_path)
    rows = [json.loads(line) for line in open(path)]
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({**row, **({"teacher": "other"} if i % 2 else {})}) + "\n")
    argv = ["--teacher_model_name_or_path", f"self={tiny_llama}", f"other={other_llama}", "--actor_learning_rate", 0]
    run = setup(parse_args(distill_args(tiny_llama, tmp_path, *argv)))
    metrics, rows = run.trainer.step(prompt_batches(run, 2, n_rows=4), step=0)
    owners = {r.prompt["extra"].get("teacher", "self") for r in rows}
    assert owners == {"self", "other"}
    for row in rows:
        diff = (row.per_action["old_logprobs"] - row.per_action["teacher_logprobs"]).abs().max()
        assert (diff == 0) == (row.prompt["extra"].get("teacher", "self") == "self")
    assert metrics["distill/self/reverse_kl_sampled_token_mean"] == 0.0
    assert metrics["distill/other/reverse_kl_sampled_token_mean"] != 0.0
    assert metrics["distill/self/top1_agreement"] == 1.0 and 0 <= metrics["distill/other/top1_agreement"] <= 1
    # (two random tiny models with tied embeddings both rank the input token first: no test of disagreement here)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4


def test_an_unknown_teacher_in_the_data_stops_before_training(tiny_llama, other_llama, tmp_path):
    path = write_rows(tmp_path)
    rows = [json.loads(line) for line in open(path)]
    path.write_text("".join(json.dumps({**r, "teacher": "nobody"}) + "\n" for r in rows))
    argv = ["--teacher_model_name_or_path", f"a={tiny_llama}", f"b={other_llama}"]
    with pytest.raises(UsageError, match="--teacher_key field 'teacher' is 'nobody', not one of the teachers a, b"):
        setup(parse_args(distill_args(tiny_llama, tmp_path, *argv)))


def test_distillation_alone_moves_the_student_towards_its_teacher(tiny_llama, other_llama, tmp_path):
    """No reward at all: the full-vocabulary reverse KL to the teacher, on the same prompts, falls as the student
    trains; the sampled signal stands alone as the advantage (the task's is 0)."""
    write_rows(tmp_path)
    base = grpo_args(tiny_llama, tmp_path, "--actor_zero_stage", 0, "--kl_ctl", 0)
    at = base.index("--reward_funcs")
    argv = base[:at] + base[at + 2 :]  # no reward
    argv += ["--teacher_model_name_or_path", other_llama, "--distill_signal", "reverse_kl"]
    run = setup(parse_args(argv + ["--actor_learning_rate", "3e-3"]))
    assert run.trainer.rewards == []
    batches = prompt_batches(run, 2, n_rows=4)
    losses = []
    for step in range(6):
        torch.manual_seed(0)
        metrics, _ = run.trainer.step(batches, step=step)
        losses.append(metrics["loss/distill"])
    assert losses[-1] < 0.8 * losses[0], losses


def test_only_the_policys_own_tokens_get_a_signal():
    """A multi-turn row's environment tokens (response_action_mask 0) are no actions: the signal the trainer
    adds is 0 there, whatever the two models' log-probs."""
    row = Row(
        prompt_ids=torch.tensor([5, 6]),
        response_ids=torch.tensor([7, 8, 9, 10, 11]),
        ended_with_eos=True,
        response_action_mask=torch.tensor([1, 1, 0, 0, 1]),
    )
    row.per_action["old_logprobs"] = torch.tensor([-1.0, -2.0, -9.0, -9.0, -3.0])  # per response token
    row.per_action["teacher_logprobs"] = torch.tensor([-1.5, -1.0, -0.1, -0.1, -4.0])  # differs at 9: env tokens
    batch = pack([row], pad_token_id=0)
    p, length = batch["prompt_len"], batch["input_ids"].shape[1]
    old, teacher = (to_token_layout([row], name, p, length) for name in ("old_logprobs", "teacher_logprobs"))
    signal = reverse_kl_sampled(old, teacher, batch["loss_mask"])
    mask = batch["loss_mask"].bool()
    assert signal[~mask].abs().sum() == 0
    assert signal[mask].tolist() == pytest.approx([0.5, -1.0, 1.0])
