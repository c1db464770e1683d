"""utils.train.loop.share_master_weights: a ZeRO-3 fp32 engine's master partition shares the parameter
partition's memory, and training gives bit for bit the weights it gave with the separate copy."""

import pytest
import torch

from utils.train.loop import share_master_weights


@pytest.fixture(scope="module")
def dist():
    from utils.runtime.distributed import init_distributed

    init_distributed()


def trained_engine(model_dir: str, stage: int = 3):
    from utils.models.loading import load_causal_lm
    from utils.train.ds_config import train_ds_config
    from utils.train.loop import EngineSpec, build_trained_engine

    config = train_ds_config(stage, 1, 2)
    torch.manual_seed(0)
    model = load_causal_lm(model_dir, None, config, 0.0)
    return build_trained_engine(model, config, EngineSpec(learning_rate=1e-2), total_steps=10)


def train(engine, steps: int = 3) -> dict:
    import deepspeed

    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 12), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=engine.zero_optimization_stage() == 3):
        return {name: p.detach().clone() for name, p in params.items()}


def test_the_shared_master_partition_trains_to_the_same_weights(dist, tiny_llama, monkeypatch):
    from utils.train import loop

    monkeypatch.setattr(loop, "share_master_weights", lambda engine: 0)  # build_trained_engine's call left out
    separate = trained_engine(tiny_llama)
    expected = train(separate)
    shared = trained_engine(tiny_llama)
    monkeypatch.undo()
    optimizer = shared.optimizer
    hp_bytes = sum(t.untyped_storage().nbytes() for t in optimizer.fp32_partitioned_groups_flat)
    assert share_master_weights(shared) == hp_bytes > 0
    for lp, hp in zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat):
        assert hp.untyped_storage().data_ptr() == lp.untyped_storage().data_ptr()
    assert share_master_weights(shared) == 0  # already shared: nothing more
    actual = train(shared)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name
    for lp, hp in zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat):
        assert hp.untyped_storage().data_ptr() == lp.untyped_storage().data_ptr()  # still one memory after steps


def test_every_trained_zero3_engine_shares_it(dist, tiny_llama):
    optimizer = trained_engine(tiny_llama).optimizer  # build_trained_engine: steps 1, 2, DPO and step 3's
    for lp, hp in zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat):
        assert hp.untyped_storage().data_ptr() == lp.untyped_storage().data_ptr()


def test_nothing_is_shared_below_stage_3(dist, tiny_llama):
    assert share_master_weights(trained_engine(tiny_llama, stage=2)) == 0
