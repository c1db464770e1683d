"""Known failures that must end with ONE readable line naming what is wrong and what to do, never a traceback:
a hub model id that is not cached while downloads are off, a reward beyond any float, a DPO checkpoint whose
reference log-probs are cut or corrupt, a checkpoint resumed by another step, every row longer than
--max_seq_len, a reward function that blocks forever without --reward_timeout, and the evaluation's hints
naming only its own flags."""

import json
import os
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

from step2_dpo.main import Reference, reference_logps_problem, restored_reference
from step3_ppo import eval as step3_eval
from step3_ppo.rewards import components
from step3_ppo.rewards.components import FunctionReward
from step3_ppo.rewards.functions import RewardFunction, RewardFunctionError, load_reward_function, score_batch
from utils.data import DataError, check_not_all_too_long, tokenize_sft
from utils.errors import UsageError
from utils.math.rows import Row
from utils.models import loading
from utils.models.loading import ModelLoadError, check_model_path, hub_load_error, load_tokenizer
from utils.train.checkpoint import (
    COMPLETE_FILE,
    LATEST_FILE,
    STATE_FILE,
    WRITERS,
    CheckpointError,
    Checkpointing,
    check_writer,
    checkpoint_writer,
)

# ---------------------------------------------------------------- a hub id that cannot be loaded


@pytest.fixture
def empty_hub_cache(monkeypatch):
    monkeypatch.setattr(loading, "in_hub_cache", lambda repo_id: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("name", ["someorg/somemodel", "gpt2"])
def test_an_uncached_hub_id_offline_is_one_line_saying_so(name, empty_hub_cache):
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(name)
    message = str(info.value)
    assert "\n" not in message and f"'{name}'" in message
    assert "neither a local directory nor in the local Hugging Face cache" in message
    assert "downloads are off" in message and "does not exist" not in message


def test_a_local_looking_path_still_does_not_exist(empty_hub_cache, tmp_path):
    for path in (str(tmp_path / "missing"), "./missing", "out/a/b"):
        with pytest.raises(ModelLoadError, match="does not exist or is not a directory"):
            check_model_path(path)


def test_a_cached_hub_id_is_left_to_from_pretrained(monkeypatch):
    monkeypatch.setattr(loading, "in_hub_cache", lambda repo_id: True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_model_path("someorg/somemodel")  # no error: transformers loads it from the cache


def test_a_failed_download_is_one_line(monkeypatch):
    monkeypatch.setattr(loading, "hub_offline", lambda: False)
    exc = OSError("We couldn't connect to 'https://huggingface.co' to load the files. Check your connection.")
    message = str(hub_load_error("someorg/somemodel", "model", exc))
    assert "neither a local directory nor in the local Hugging Face cache" in message
    assert "downloading it failed (We couldn't connect to 'https://huggingface.co' to load the files)" in message
    assert hub_load_error("someorg/somemodel", "model", ValueError("x")) is None  # not a fetch failure


# ---------------------------------------------------------------- a reward beyond any float


def _batch(n: int) -> dict:
    return dict(
        prompts=["p"] * n,
        completions=["c"] * n,
        completion_ids=[[1]] * n,
        extra={},
        origins=[f"data/x.jsonl:{i + 1}" for i in range(n)],
    )


def test_an_int_reward_too_big_for_a_float_is_a_bad_reward():
    func = RewardFunction("huge", lambda completions, **kw: [10**400, 1.0, -(10**5000)])
    with pytest.raises(RewardFunctionError) as info:
        score_batch(func, **_batch(3))
    message = str(info.value)
    assert message.startswith("reward function huge: returned an integer of about 401 digits")
    assert "row data/x.jsonl:1" in message and "1 more bad rows" in message
    scores, bad = score_batch(func, skip_bad=True, **_batch(3))
    assert bad == [0, 2] and torch.isnan(scores[0]) and scores[1] == 1.0


# ---------------------------------------------------------------- DPO's stored reference log-probs


def test_reference_logps_problems():
    assert reference_logps_problem([[-1.0, -2.0], [-3, -4.5]], 2) is None
    assert "3 entries for 5 pairs" in reference_logps_problem([[-1.0, -2.0]] * 3, 5)
    assert "entry 1 is [nan, 1.0]" in reference_logps_problem([[-1.0, -2.0], [float("nan"), 1.0]], None)
    assert "entry 0 is 'x'" in reference_logps_problem(["x"], 1)
    assert "not a list" in reference_logps_problem({"a": 1}, 1)


def test_cut_precomputed_reference_logps_stop_with_one_line_naming_the_file(tmp_path):
    state = {"ref_logps": {"eval": [[-1.0, -2.0]] * 2, "train": [[-1.0, -2.0]] * 3}}
    with pytest.raises(CheckpointError) as info:
        restored_reference(state, str(tmp_path), Reference("precomputed", None), 2, 5, rescore=None)
    message = str(info.value)
    assert message.startswith(os.path.join(str(tmp_path), STATE_FILE))
    assert "train: 3 entries for 5 pairs" in message and "cannot be recomputed" in message


def test_corrupt_held_out_reference_logps_are_recomputed_with_a_frozen_reference(tmp_path, capsys):
    for stored in ({"eval": [[None, 1.0]]}, None, {"eval": "cut"}):
        state = {"ref_logps": stored} if stored is not None else {}
        restored_reference(state, str(tmp_path), Reference("engine", None), 1, 5, rescore=lambda: [[-1.0, -2.0]])
        assert state["ref_logps"] == {"eval": [[-1.0, -2.0]]}
        assert "recomputing those of the 1 held-out pairs with the reference" in capsys.readouterr().out
    intact = {"ref_logps": {"eval": [[-1.0, -2.0]]}}
    restored_reference(intact, str(tmp_path), Reference("engine", None), 1, 5, rescore=None)  # nothing to do


# ---------------------------------------------------------------- a checkpoint resumed by another step


def _parser_flags(module: str) -> dict:
    from importlib import import_module

    parser = import_module(module).build_parser()
    return {action.dest: action.default for action in parser._actions if action.dest not in ("help", "config")}


ENTRY_POINTS = ("step1_sft.main", "step2_reward.main", "step2_dpo.main", "step3_ppo.main")


def test_every_training_entry_point_is_told_apart_by_its_flags():
    writers = [checkpoint_writer(_parser_flags(module)) for module in ENTRY_POINTS]
    assert None not in writers and len(set(writers)) == len(WRITERS) == len(ENTRY_POINTS)
    for module, writer in zip(ENTRY_POINTS, writers):
        assert module in writer


def test_a_checkpoint_of_another_step_names_the_step_that_wrote_it(tmp_path):
    sft, reward = _parser_flags("step1_sft.main"), _parser_flags("step2_reward.main")
    check_writer("ckpt", sft, sft)
    check_writer("ckpt", None, sft)  # a checkpoint without flags: not told
    step = tmp_path / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / COMPLETE_FILE).write_text("")
    (step / STATE_FILE).write_text(json.dumps({"flags": sft, "world_size": 1, "engines": ["model"]}))
    (tmp_path / "checkpoints" / LATEST_FILE).write_text("step-00000002")
    args = SimpleNamespace(**{**reward, "output_dir": str(tmp_path), "resume": True, "data_path": []})
    with pytest.raises(CheckpointError) as info:
        Checkpointing(args, {"model": None}).restore()
    message = str(info.value)
    assert "\n" not in message and str(step) in message
    assert "written by step 1 (SFT, step1_sft.main)" in message and "step2_reward.main" in message


# ---------------------------------------------------------------- every row longer than --max_seq_len


def test_all_rows_too_long_says_so_with_the_count_and_the_longest(tiny_chat_llama):
    tokenizer = load_tokenizer(tiny_chat_llama)
    rows = [
        {"messages": [{"role": "user", "content": "word " * (20 + i)}, {"role": "assistant", "content": "ok"}]}
        for i in range(3)
    ]
    examples, stats = tokenize_sft(rows, tokenizer, 16)
    assert examples == [] and stats["skipped"] == {"too_long": 3} and stats["longest_too_long"] > 16
    with pytest.raises(DataError) as info:
        check_not_all_too_long(examples, stats, 16, "training")
    message = str(info.value)
    assert message.startswith(
        f"every one of the 3 training rows was longer than --max_seq_len 16 (the longest: "
        f"{stats['longest_too_long']} tokens)"
    )
    assert "raise --max_seq_len" in message
    check_not_all_too_long(examples, {"skipped": {}}, 16, "training")  # an empty split is said elsewhere
    check_not_all_too_long([{}], stats, 16, "training")  # some rows fit: not this error
    mixed = {"skipped": {"too_long": 2, "template_mismatch": 1}, "skipped_empty": 1}
    with pytest.raises(DataError, match=r"no held-out row is usable: 2 were longer than --max_seq_len 16, the others"):
        check_not_all_too_long([], mixed, 16, "held-out")


# ---------------------------------------------------------------- a reward function that blocks forever

HANGS = """
import time

def hangs(completions, **kwargs):
    while True:  # catches every exception, so nothing but a kill ends it
        try:
            time.sleep(60)
        except BaseException:
            pass
"""


def test_a_hung_reward_function_without_reward_timeout_ends_at_the_default(tmp_path, monkeypatch):
    assert components.DEFAULT_REWARD_TIMEOUT_S == 120.0
    monkeypatch.setattr(components, "DEFAULT_REWARD_TIMEOUT_S", 1.0)
    path = tmp_path / "hangs.py"
    path.write_text(HANGS)
    tokenizer = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: ["c" for _ in ids])
    reward = FunctionReward(load_reward_function(f"{path}:hangs"), tokenizer)  # no --reward_timeout
    row = Row(torch.tensor([1]), torch.tensor([2]), True, group=0, prompt={"prompt": "p", "origin": "x.jsonl:1"})
    start = time.monotonic()
    try:
        with pytest.raises(RewardFunctionError) as info:
            reward([row])
    finally:
        reward.worker.stop()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"reward function {path}:hangs: ran past the default limit")
    assert "of 1 s" in message and time.monotonic() - start < 30
    assert FunctionReward(load_reward_function("format"), tokenizer, timeout=5.0).deadline == "--reward_timeout"


# ---------------------------------------------------------------- the evaluation names only its own flags


def test_eval_hints_name_no_flag_eval_lacks(tiny_gpt2, tmp_path):
    remote = tmp_path / "remote"
    shutil.copytree(tiny_gpt2, remote)
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))
    argv = ["--sft_model", tiny_gpt2, "--rlhf_model", str(remote), "--reward_model", tiny_gpt2]
    with pytest.raises(UsageError) as info:
        step3_eval.main(argv)
    message = str(info.value)
    assert "ships its own Python code" in message and "it has no --trust_remote_code" in message
    assert "pass --trust_remote_code" not in message
    eval_flags = {option for action in step3_eval.build_parser()._actions for option in action.option_strings}
    assert "--trust_remote_code" not in eval_flags  # else the hint should name it


# ---------------------------------------------------------------- a --resume that cannot continue, before loading
def test_a_resume_with_a_changed_flag_stops_before_any_model_loads(tiny_gpt2, tmp_path):
    """The checkpoint `latest` names is compared with the run's flags as the checks end (the rollout engine's
    worker would otherwise start first, a minute on CPU), and another step's checkpoint is named as such."""
    import step3_ppo.main as step3  # lazy: the step's imports only for this test
    from utils.train.checkpoint import CheckpointError, run_flags

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n' * 8)
    out = tmp_path / "out"
    argv = ["--actor_model_name_or_path", tiny_gpt2, "--data_path", str(data), "--output_dir", str(out)]
    argv += ["--reward_funcs", "math_exact", "--advantage_estimator", "grpo", "--n_samples_per_prompt", "2"]
    saved = run_flags(step3.parse_args(argv))
    checkpoint = out / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-00000002")
    (checkpoint / "state.json").write_text(json.dumps({"flags": {**saved, "rollout_engine": "vllm"}}))
    with pytest.raises(CheckpointError, match=r"--rollout_engine 'vllm' \(this run: 'hf'\)"):
        step3.parse_args(argv + ["--resume"])
    (checkpoint / "state.json").write_text(json.dumps({"flags": {"train_on_last_turn_only": False}}))
    with pytest.raises(CheckpointError, match=r"was written by step 1 \(SFT, step1_sft.main\), and this is step 3"):
        step3.parse_args(argv + ["--resume"])
    (checkpoint / "state.json").write_text(json.dumps({"flags": saved}))
    assert step3.parse_args(argv + ["--resume"]).resume  # the same flags: on to loading


# ---------------------------------------------------------------- a killed trainer's vLLM folders
def test_the_folders_of_killed_runs_go_when_a_worker_starts(tmp_path):
    """A trainer killed by SIGKILL never runs close(): its rlhf-vllm-* folder is removed by a later run once its
    rank is gone and it is an hour old (a failed run's log stays that long); a live run's folder stays."""
    import subprocess  # lazy: only this test makes a process to outlive

    from step3_ppo.rollout.vllm_engine import DIR_PREFIX, OWNER_FILE, STALE_DIR_S, remove_stale_dirs

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that existed and is no more
    folders = {}
    for name, owner, age in [
        ("dead_old", gone.pid, 2),
        ("live_old", os.getpid(), 2),
        ("dead_new", gone.pid, 0),
        ("nameless_old", None, 2),
    ]:
        path = tmp_path / f"{DIR_PREFIX}{name}"
        path.mkdir()
        if owner is not None:
            (path / OWNER_FILE).write_text(str(owner))
        stamp = time.time() - age * STALE_DIR_S
        os.utime(path, (stamp, stamp))
        folders[name] = path
    (tmp_path / "unrelated").mkdir()
    removed = remove_stale_dirs(str(tmp_path))
    assert sorted(removed) == sorted(str(folders[n]) for n in ("dead_old", "nameless_old"))
    assert folders["live_old"].exists() and folders["dead_new"].exists() and (tmp_path / "unrelated").exists()


# ---------------------------------------------------------------- an output folder that is a file
def test_an_output_dir_or_tensorboard_path_on_a_file_is_one_line(tiny_gpt2, tmp_path):
    """It was a NotADirectoryError / FileExistsError traceback on every rank once the run began writing."""
    from step1_sft.main import parse_args as step1_args  # lazy: the step's imports only for this test

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    argv = ["--model_name_or_path", tiny_gpt2, "--data_path", str(data)]
    with pytest.raises(UsageError, match=f"^--output_dir {a_file}/out: {a_file} is a file, not a folder$"):
        step1_args(argv + ["--output_dir", str(a_file / "out")])
    out = ["--output_dir", str(tmp_path / "out"), "--enable_tensorboard"]
    with pytest.raises(UsageError, match=f"^--tensorboard_path {a_file}: {a_file} is a file, not a folder$"):
        step1_args(argv + out + ["--tensorboard_path", str(a_file)])
    assert step1_args(argv + out + ["--tensorboard_path", str(tmp_path / "tb" / "deep")]).enable_tensorboard
