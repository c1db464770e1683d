"""Run by tests/test_step_normalisation.py under the `deepspeed` launcher (2 CPU ranks): the gradients of
one optimizer step of (micro-batch m, accumulation k, ranks r), taken through the product's own loops, against
those of ONE batch of all m.k.r rows in a plain torch copy of the model (no DeepSpeed, no accumulation).

Cases: step 1's SFT loss (utils.train.loop.train_micro_batches with step1_sft's terms and counts), the DPO
loss with its NLL term (the same loop with step2_dpo's PreferenceLoss), and step 3's PPO loss with the
entropy bonus, token_mean and seq_mean (PPOTrainer.train_epochs). Every case has ragged lengths, masked
tokens (prompts, padding, rows left out of the loss) and a last, partial accumulation window. The engine
runs ZeRO 0, fp32, SGD at lr 0 (the weights never move, so every step is compared with the same reference);
the gradient DeepSpeed hands its optimizer (accumulated, averaged over ranks) is read in `engine.step`.
Rank 0 writes {case: {"rel_err": [per step], "logged": [...], "expected": [...], "old_rel_err": [...]}} as JSON:
rel_err = ||g - g_ref|| / ||g_ref||; old_rel_err the same for the former per-micro-batch normalisation (a
control: it must differ on this ragged data).

    deepspeed --num_gpus 2 --module tests.step_normalisation_probe MODEL_DIR OUT.json WORK_DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from types import SimpleNamespace

import torch

M, K = 2, 2  # micro-batch rows, accumulation steps (the full windows); ranks: the launcher's


def flat_grads(params) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double() for p in params]
    )


def rel_err(g: torch.Tensor, ref: torch.Tensor) -> float:
    return float((g - ref).norm() / ref.norm())


class Capture:
    """The gradients DeepSpeed's optimizer would apply, read at each boundary `engine.step()`."""

    def __init__(self, engine):
        self.engine, self.grads, self._step = engine, [], engine.step
        engine.step = self.step

    def step(self, *args, **kwargs):
        if self.engine.is_gradient_accumulation_boundary():
            self.grads.append(flat_grads(self.engine.module.parameters()))
        return self._step(*args, **kwargs)


def reference_grads(model, loss_fn) -> tuple[torch.Tensor, float]:
    """(grads, loss) of `loss_fn(model)` on the plain copy."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    grads = flat_grads(model.parameters())
    model.zero_grad(set_to_none=True)
    return grads, loss.item()


def run_args(work: str, name: str) -> argparse.Namespace:
    return argparse.Namespace(
        output_dir=os.path.join(work, name),
        num_train_epochs=1,
        max_bad_steps=3,
        enable_tensorboard=False,
        tensorboard_path=None,
    )


class Sampler:
    def set_epoch(self, epoch):
        pass


def train_steps(engine, work: str, name: str, batches: list, micro_step, counts, steps: int) -> list[float]:
    """`steps` optimizer steps of utils.train.loop.train_micro_batches over this rank's `batches`; the logged losses."""
    from utils.train.loop import train_micro_batches
    from utils.train.run import Run

    logged = []

    def step_metrics(means):
        logged.append(means[0])
        return {"train/loss": means[0]}, {}, None

    run = Run(run_args(work, name), "probe", "probe", {}, None, total_steps=steps)
    run.restore()
    train_micro_batches(run, engine, batches, Sampler(), micro_step, step_metrics, counts=counts)
    run.logger.close()
    return logged


def sft_examples(n: int, generator: torch.Generator, vocab: int) -> list[dict]:
    """Ragged examples: prompt (not trained) + response (trained); every 5th trains on nothing."""
    examples = []
    for i in range(n):
        p, t = int(torch.randint(1, 9, (), generator=generator)), int(torch.randint(1, 12, (), generator=generator))
        ids = torch.randint(5, vocab, (p + t,), generator=generator).tolist()
        labels = [-100] * p + ids[p:] if i % 5 != 4 else [-100] * (p + t)
        examples.append({"input_ids": ids, "labels": labels})
    return examples


def case_sft(engine, plain, capture, tokenizer, work, rank, ranks, generator) -> dict:
    from step1_sft.main import sft_loss_terms, trained_tokens
    from utils.data import SFTCollator
    from utils.models.forward import lm_nll

    collate = SFTCollator(tokenizer.pad_token_id)
    windows = [M * K * ranks, M * ranks]  # one full window, then a partial one (a single micro-batch per rank)
    examples = sft_examples(sum(windows), generator, len(tokenizer))
    # rank r's micro-batches, in order: window w's micro-batch j holds the rows of slot (w, j, r)
    slots, start = [], 0
    for size in windows:
        rows = examples[start : start + size]
        per_micro = [rows[i : i + M] for i in range(0, size, M)]
        slots.append(per_micro)
        start += size
    mine = [collate(micro) for per_micro in slots for micro in per_micro[rank::ranks]]
    before = len(capture.grads)
    logged = train_steps(
        engine, work, "sft", mine, lambda batch: sft_loss_terms(engine, batch), trained_tokens, len(windows)
    )
    out = {"rel_err": [], "logged": logged, "expected": [], "old_rel_err": []}
    for w, per_micro in enumerate(slots):

        def whole(model, rows=sum(per_micro, [])):
            nll, count = lm_nll(model, collate(rows))
            return nll / count

        ref, value = reference_grads(plain, whole)
        out["rel_err"].append(rel_err(capture.grads[before + w], ref))
        out["expected"].append(value)
        # the former normalisation: each micro-batch's own mean, averaged over micro-batches and ranks
        old = sum(
            reference_grads(
                plain, lambda model, rows=micro: (lambda nc: nc[0] / nc[1].clamp(min=1))(lm_nll(model, collate(rows)))
            )[0]
            for micro in per_micro
        ) / len(per_micro)
        out["old_rel_err"].append(rel_err(old, ref))
    return out


def case_dpo(engine, plain, capture, tokenizer, work, rank, ranks, generator) -> dict:
    from step2_dpo.main import PreferenceLoss
    from utils.data import PreferenceCollator
    from utils.models.forward import sequence_logprobs

    collate = PreferenceCollator(tokenizer.pad_token_id)
    loss_of = PreferenceLoss(SimpleNamespace(beta=0.1, loss_type="sigmoid", nll_loss_coef=0.5, label_smoothing=0.0))
    vocab = len(tokenizer)

    def pair():
        lengths = [int(torch.randint(1, 10, (), generator=generator)) for _ in range(3)]
        ids = [torch.randint(5, vocab, (n,), generator=generator).tolist() for n in lengths]
        return {
            "prompt_input_ids": ids[0],
            "chosen_response_ids": ids[1],
            "rejected_response_ids": ids[2],
            "ref_chosen_logp": -float(torch.rand((), generator=generator)) * 20,
            "ref_rejected_logp": -float(torch.rand((), generator=generator)) * 20,
        }

    windows = [M * K * ranks, M * ranks]
    slots = []
    for size in windows:
        rows = [pair() for _ in range(size)]
        # ragged pair counts too: micro-batches of 1 and 3 pairs around the window's mean of M
        cuts = [0] + [i for i in range(1, size) if i % M == 0] + [size]
        per_micro = [rows[a:b] for a, b in zip(cuts, cuts[1:])]
        if len(per_micro) >= 2:
            per_micro[0], per_micro[1] = per_micro[0][:1], per_micro[0][1:] + per_micro[1]
        slots.append(per_micro)
    mine = [collate(micro) for per_micro in slots for micro in per_micro[rank::ranks]]

    def micro_step(batch):
        logps, counts = sequence_logprobs(engine, batch)
        return loss_of.terms(logps, counts, batch["ref_logps"])[0], ()

    before = len(capture.grads)
    logged = train_steps(engine, work, "dpo", mine, micro_step, loss_of.units, len(windows))
    out = {"rel_err": [], "logged": logged, "expected": [], "old_rel_err": []}
    for w, per_micro in enumerate(slots):

        def whole(model, rows=sum(per_micro, [])):
            batch = collate(rows)
            logps, counts = sequence_logprobs(model, batch)
            return loss_of(logps, counts, batch["ref_logps"])[0]

        ref, value = reference_grads(plain, whole)
        out["rel_err"].append(rel_err(capture.grads[before + w], ref))
        out["expected"].append(value)

        def micro_mean(model, rows):
            batch = collate(rows)
            logps, counts = sequence_logprobs(model, batch)
            return loss_of(logps, counts, batch["ref_logps"])[0]

        old = sum(
            reference_grads(plain, lambda model, rows=micro: micro_mean(model, rows))[0] for micro in per_micro
        ) / len(per_micro)
        out["old_rel_err"].append(rel_err(old, ref))
    return out


def ppo_rows(n: int, generator: torch.Generator, vocab: int, plain, pad_id: int):
    """Ragged rollout rows; every 4th left out of the loss; old log-probs = the model's + noise (some ratios
    clipped), random per-token advantages."""
    from utils.math.rows import Row, from_token_layout, pack
    from utils.models.forward import token_logprobs

    rows = []
    for i in range(n):
        p, t = int(torch.randint(1, 8, (), generator=generator)), int(torch.randint(1, 10, (), generator=generator))
        rows.append(
            Row(
                prompt_ids=torch.randint(5, vocab, (p,), generator=generator),
                response_ids=torch.randint(5, vocab, (t,), generator=generator),
                ended_with_eos=True,
                group=i,
                trained=i % 4 != 3,
            )
        )
    batch = pack(rows, pad_id)
    with torch.no_grad():
        logprobs = token_logprobs(plain, batch)
    noise = 0.15 * torch.randn(logprobs.shape, generator=generator)
    from_token_layout(rows, "old_logprobs", logprobs + noise, batch["prompt_len"])
    from_token_layout(rows, "ref_logprobs", logprobs, batch["prompt_len"])
    from_token_layout(rows, "advantages", torch.randn(logprobs.shape, generator=generator), batch["prompt_len"])
    return rows


def case_ppo(engine, plain, capture, tokenizer, rank, ranks, generator, loss_agg: str) -> dict:
    from step3_ppo.algo.shaping import FixedKLController
    from step3_ppo.trainer import PPOConfig, PPOTrainer
    from utils.math import losses
    from utils.math.rows import pack, to_token_layout
    from utils.models.forward import token_logprobs
    from utils.runtime.distributed import all_reduce_sum

    config = PPOConfig(
        stop_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        per_device_training_batch_size=M,
        advantage_estimator="rloo",
        n_samples_per_prompt=2,
        loss_agg=loss_agg,
        entropy_coef=0.01,
        max_answer_seq_len=10,
        seed=5,
    )
    trainer = PPOTrainer(SimpleNamespace(actor=engine, ref=None, critic=None), config, FixedKLController(0.0), [])
    per_rank = M * (K + 1)  # one full window and a partial one of a single mini-batch
    all_rows = ppo_rows(per_rank * ranks, generator, len(tokenizer), plain, tokenizer.pad_token_id)
    rank_rows = [all_rows[r * per_rank : (r + 1) * per_rank] for r in range(ranks)]
    before = len(capture.grads)
    stats, steps = trainer.train_epochs(rank_rows[rank], step=0)
    assert steps == 2, steps
    # the logged actor loss of each step: its mini-batches' parts, summed over ranks
    logged = all_reduce_sum([sum(s["loss/actor"] for s in stats[:K]), sum(s["loss/actor"] for s in stats[K:])])
    # every rank's windows, as train_epochs cut them (the shuffle depends on the seed and the row count only)
    windows = [[], []]
    micro_by_window = [[], []]
    for r in range(ranks):
        minibatches = trainer.minibatches(rank_rows[r], 0, 0)
        windows[0] += sum(minibatches[:K], [])
        windows[1] += sum(minibatches[K:], [])
        micro_by_window[0] += minibatches[:K]
        micro_by_window[1] += minibatches[K:]
    agg = {"loss_agg": loss_agg, "agg_constant": config.max_answer_seq_len}

    def loss_on(model, rows, actor_only=False):
        batch = pack(rows, config.pad_token_id)
        p, length = batch["prompt_len"], batch["input_ids"].shape[1]
        old = {name: to_token_layout(rows, name, p, length) for name in ("old_logprobs", "advantages")}
        logprobs, entropy = token_logprobs(model, batch, return_entropy=True, entropy_grad=True)
        actor, _ = losses.policy_loss(
            logprobs, old["old_logprobs"], old["advantages"], batch["action_mask"], loss_mask=batch["loss_mask"], **agg
        )
        if actor_only:
            return actor
        return actor - config.entropy_coef * losses.entropy_bonus(entropy, batch["loss_mask"], **agg)

    out = {"rel_err": [], "logged": logged, "expected": [], "old_rel_err": []}
    for w, rows in enumerate(windows):
        ref, _ = reference_grads(plain, lambda model: loss_on(model, rows))
        out["rel_err"].append(rel_err(capture.grads[before + w], ref))
        with torch.no_grad():
            out["expected"].append(loss_on(plain, rows, actor_only=True).item())
        old = sum(
            reference_grads(plain, lambda model, mb=mb: loss_on(model, mb))[0] for mb in micro_by_window[w]
        ) / len(micro_by_window[w])
        out["old_rel_err"].append(rel_err(old, ref))
    return out


def main(argv=None):
    model_dir, out_path, work = [a for a in (argv or sys.argv[1:]) if not a.startswith("--local_rank")][:3]
    from utils.models.loading import load_causal_lm, load_tokenizer
    from utils.runtime.distributed import init_distributed, rank, world_size
    from utils.train.ds_config import train_ds_config
    from utils.train.loop import initialize_engine

    init_distributed()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tokenizer, dropout=0.0)
    plain = copy.deepcopy(model)  # the reference: one batch of every rank's rows, plain torch
    plain.train()
    config = train_ds_config(0, world_size(), M, K, "fp32", gradient_clipping=0.0)
    engine = initialize_engine(model, config, torch.optim.SGD(model.parameters(), lr=0.0))
    engine.train()
    capture = Capture(engine)
    generator = torch.Generator().manual_seed(1234)  # the same rows on every rank
    results = {
        "sft": case_sft(engine, plain, capture, tokenizer, work, rank(), world_size(), generator),
        "dpo": case_dpo(engine, plain, capture, tokenizer, work, rank(), world_size(), generator),
    }
    for agg in ("token_mean", "seq_mean"):
        results[f"ppo_{agg}"] = case_ppo(engine, plain, capture, tokenizer, rank(), world_size(), generator, agg)
    if rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": world_size(), **results}, f, indent=1)
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
