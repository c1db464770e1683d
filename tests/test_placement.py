"""Device placement has one home (utils/models/forward.py): every helper moves a CPU batch to the model's device,
and no model forward of the project bypasses the helpers.

CUDA is not here, so the "other device" is `meta`: a hand-made module with the HF call signature whose
parameter lives on meta. An elementwise op between a CPU input and a meta parameter raises ("Tensor on device
meta is not on the expected device cpu"), exactly as a CPU batch given to a CUDA model would.
"""

import ast
import os

import pytest
import torch
from torch import nn

from tests.test_layering import python_files  # the project's .py files, not a venv kept under bench/
from utils.math.rows import Row, pack
from utils.models import forward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 11


class MetaCausalLM(nn.Module):
    """HF-style causal LM (input_ids, attention_mask, position_ids, use_cache -> .logits) on `meta`."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(VOCAB, device="meta"))
        self.seen_devices = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        self.seen_devices += [t.device.type for t in (input_ids, attention_mask, position_ids)]
        one_hot = nn.functional.one_hot(input_ids, VOCAB).float()
        logits = one_hot * self.scale * attention_mask[..., None] + position_ids[..., None]  # raises on CPU input
        return type("Out", (), {"logits": logits})()

    def generate(self, input_ids, attention_mask, **kwargs):
        self.seen_devices += [input_ids.device.type, attention_mask.device.type]
        return torch.cat([input_ids, input_ids[:, -1:]], dim=1) + self.scale[:1].long()  # raises on CPU input


class MetaValueModel(nn.Module):
    """RewardModel-style (input_ids, attention_mask) -> values [B, L], on `meta`."""

    def __init__(self):
        super().__init__()
        self.head = nn.Parameter(torch.ones(1, device="meta"))

    def forward(self, input_ids, attention_mask):
        return input_ids.float() * attention_mask * self.head  # raises on a CPU input


def cpu_batch():
    rows = [
        Row(prompt_ids=torch.tensor([1, 2, 3]), response_ids=torch.tensor([4, 5]), ended_with_eos=True),
        Row(prompt_ids=torch.tensor([6]), response_ids=torch.tensor([7, 8, 9]), ended_with_eos=False),
    ]
    batch = pack(rows, pad_token_id=0)
    batch["labels"] = torch.where(
        batch["attention_mask"].bool(), batch["input_ids"], torch.full_like(batch["input_ids"], -100)
    )
    return batch


def test_the_stand_in_really_refuses_a_cpu_batch():
    batch = cpu_batch()
    with pytest.raises(RuntimeError, match="device"):
        MetaCausalLM()(batch["input_ids"], batch["attention_mask"], batch["attention_mask"], False)
    with pytest.raises(RuntimeError, match="device"):
        MetaValueModel()(batch["input_ids"], batch["attention_mask"])


@pytest.mark.parametrize("helper", ["causal_lm_logits", "token_logprobs", "lm_nll", "generate"])
def test_causal_lm_helpers_move_a_cpu_batch_to_the_models_device(helper):
    model, batch = MetaCausalLM(), cpu_batch()
    assert forward.model_device(model).type == "meta"
    if helper == "causal_lm_logits":
        out = forward.causal_lm_logits(model, batch["input_ids"], batch["attention_mask"])
    elif helper == "token_logprobs":
        out, _ = forward.token_logprobs(model, batch, temperature=0.7, return_entropy=True)
    elif helper == "lm_nll":
        out, _ = forward.lm_nll(model, batch)
    else:
        out = forward.generate(model, batch["input_ids"], batch["attention_mask"])
    assert out.device.type == "meta"
    assert model.seen_devices and set(model.seen_devices) == {"meta"}


@pytest.mark.parametrize("helper", ["token_values", "sequence_scores"])
def test_value_model_helpers_move_a_cpu_batch_to_the_models_device(helper, monkeypatch):
    batch = cpu_batch()
    # the score's index check reads a value (.item()), which meta tensors cannot give: keep the values
    monkeypatch.setattr(forward, "sequence_score", lambda values, mask: values)
    out = getattr(forward, helper)(MetaValueModel(), batch["input_ids"], batch["attention_mask"])
    assert out.device.type == "meta"


def test_model_device_reads_an_engines_device_attribute():
    engine = type("Engine", (), {"device": torch.device("meta"), "parameters": lambda self: iter(())})()
    assert forward.model_device(engine) == torch.device("meta")
    assert forward.to_device({"a": torch.ones(1), "n": 3}, torch.device("meta"))["a"].device.type == "meta"


# --------------------------------------------------------------------------- #
# No forward bypasses the helpers
# --------------------------------------------------------------------------- #
PROJECT_CODE = ("step1_sft", "step2_reward", "step2_dpo", "step3_ppo", "utils", "chat.py", "bench")
MODEL_INPUT_KEYWORDS = {"input_ids", "attention_mask", "inputs_embeds", "position_ids"}
MODEL_METHODS = {"generate", "forward"}
# A model's own forward calling its backbone is inside the model, not a call site of the project.
# bench/step3.py's logits_to_keep_logprobs is the A/B's PROPOSED alternative to utils.models.forward.token_logprobs
# (the LM head only over the response positions): a variant of the helper, placing its inputs itself with
# utils.models.forward.model_device. The trainer's generate_rows calls a rollout engine's `generate`, not a model's:
# the engine places its inputs itself (ActorGenerate through step3_ppo.rollout.hybrid.generate -> utils.models.forward,
# whose own call is checked here); so does the multi-turn rollout's generate_turn (step3_ppo/agents/loop.py), the same
# engine turn by turn, and bench/vllm_engine.py's worker, which times both engines. The vLLM worker's generate
# and score (a served teacher's prompt log-probs) are vLLM's own `LLM.generate` on token-id lists (vLLM places them
# on its device). Each exception is one named function, never a whole file or folder.
ALLOWED = {
    ("utils/models/forward.py", "*"),
    ("utils/models/reward_model.py", "forward"),
    ("bench/step3.py", "logits_to_keep_logprobs"),
    ("step3_ppo/trainer.py", "generate_rows"),
    ("step3_ppo/agents/loop.py", "generate_turn"),
    ("step3_ppo/rollout/vllm_worker.py", "generate"),
    ("step3_ppo/rollout/vllm_worker.py", "score"),
    ("bench/vllm_engine.py", "worker"),
}


def project_files():
    out = []
    for entry in PROJECT_CODE:
        path = os.path.join(ROOT, entry)
        if os.path.isfile(path):
            out.append(entry)
            continue
        out += python_files(entry)
    return sorted(out)


def model_calls(path: str) -> list[str]:
    """Calls that look like a model forward or generate: keyword model inputs, or .generate()/.forward()."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read(), path)
    found = []

    def visit(node, function: str):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                keywords = {k.arg for k in child.keywords if k.arg}
                method = child.func.attr if isinstance(child.func, ast.Attribute) else None
                if (
                    (keywords & MODEL_INPUT_KEYWORDS or method in MODEL_METHODS)
                    and (path, function) not in ALLOWED
                    and (path, "*") not in ALLOWED
                ):
                    found.append(f"{path}:{child.lineno} in {function}(): {ast.unparse(child)[:80]}")
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_the_scan_finds_a_bypassing_forward(tmp_path, monkeypatch):
    (tmp_path / "bad.py").write_text(
        "def f(model, ids, mask):\n    return model(input_ids=ids, attention_mask=mask)\n"
        "def g(model, x):\n    return model.generate(x)\n"
    )
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path))
    assert len(model_calls("bad.py")) == 2


def test_every_model_forward_goes_through_utils_forward():
    bypasses = [call for path in project_files() for call in model_calls(path)]
    assert not bypasses, (
        "model forwards outside utils/models/forward.py (inputs not placed on the model's device):\n"
        + "\n".join(bypasses)
    )
