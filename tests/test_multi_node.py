"""The multi-node path: two `deepspeed --hostfile H --no_ssh --node_rank i` launchers, one rank each.

Where the tests run as root with `ip netns`, each node lives in its own network namespace and the
two are joined by a veth pair (10.77.0.1 <-> 10.77.0.2), so the rendezvous and every gloo
collective really cross between two "hosts"; otherwise both nodes share the loopback interface
(`test_network_namespaces_used` then skips and says why).

1. Step 1 (ZeRO-3, fp32) and step 3 (ZeRO-3 actor and critic) on two nodes give the same metrics
   as the same arguments on one node with 2 ranks, and the shared output directory is written once.
2. A node that is SIGKILLed mid-run makes the surviving node exit non-zero promptly (the peer's
   TCP connections are reset); a node that vanishes from the network (link down, then killed: no
   reset ever arrives) makes it exit after `--dist_timeout` seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time

import pytest

from tests.launch import metrics
from tests.launch import subprocess_env as base_env  # aliased: pytest would collect a test_* name
from tests.multinode import nodes_running, run_nodes, single_node_running, two_nodes, write_hostfile
from tests.test_step1_run import common_args, sft_data  # noqa: F401  (sft_data is a fixture)
from tests.test_step3_lr0 import write_prompts

REL_TOL = 1e-5
ABS_FLOOR = 1e-7  # for values that are ~0 by construction (the first PPO actor loss is -mean(whitened adv))
DIST_TIMEOUT = 15


@pytest.fixture(scope="module")
def cluster():
    with two_nodes() as c:  # namespaces and veth pair are deleted when the module's tests are done
        if c.mode != "netns":
            print(f"\n[multi-node] network namespaces not used ({c.reason}); both nodes use the loopback interface")
        yield c


def test_network_namespaces_used(cluster):
    if cluster.mode != "netns":
        pytest.skip(f"two-node tests ran over loopback, not network namespaces: {cluster.reason}")
    assert cluster.master_addr == "10.77.0.1"


def veth_bytes(cluster) -> int:
    """Bytes received by node 0 on its veth end (0 over loopback, where nothing can be measured)."""
    node = cluster.nodes[0]
    if node.netns is None:
        return 0
    out = subprocess.run(
        ["ip", "-n", node.netns, "-j", "-s", "link", "show", "dev", node.ifname],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)[0]["stats64"]["rx"]["bytes"]


def compare_rows(one: list[dict], two: list[dict], keys: list[str]) -> float:
    """Same steps, same keys; returns the largest relative difference over `keys`."""
    assert [r["step"] for r in two] == [r["step"] for r in one]
    worst = 0.0
    for a, b in zip(one, two):
        assert sorted(a) == sorted(b), (a, b)
        for key in keys:
            if key not in a:
                continue
            assert b[key] == pytest.approx(a[key], rel=REL_TOL, abs=ABS_FLOOR), (a["step"], key, a[key], b[key])
            worst = max(worst, abs(b[key] - a[key]) / max(abs(a[key]), ABS_FLOOR))
    assert all(any(k in r for r in one) for k in keys), keys
    return worst


def two_node_run(cluster, tmp_path, module, args, timeout=600, **kwargs):
    """Runs `module` on both nodes; returns the run after checking both joined one world of 2 ranks."""
    hostfile = write_hostfile(tmp_path / "hostfile", cluster)
    before = veth_bytes(cluster)
    run = run_nodes(cluster, hostfile, module, args, tmp_path, timeout=timeout, **kwargs)
    received = veth_bytes(cluster) - before
    for node in run.nodes:
        assert "nnodes=2, num_local_procs=1" in node.log() and "dist_world_size=2" in node.log(), run.logs()
    if cluster.mode == "netns":
        print(f"\n[multi-node] node 0 received {received / 1e6:.1f} MB over the veth pair")
        assert received > 5e6, received  # ZeRO-3 gathers node 1's parameter shards at every forward
    return run


def one_and_two_nodes(cluster, tmp_path, module, args_one, args_two, **kwargs):
    """The single-node 2-rank reference (run_deepspeed's command) runs in the background while the two
    nodes run: on a loaded 2-core machine they overlap their start-up and waits instead of adding them up."""
    with single_node_running(module, args_one, str(tmp_path / "one.log")) as single:
        run = two_node_run(cluster, tmp_path, module, args_two, **kwargs)
        with contextlib.suppress(subprocess.TimeoutExpired):
            single.proc.wait(timeout=600)
    return single, run


def output_files(out: str) -> set[str]:
    """Files under `out`, without the per-node logs that run_multi_node.sh tees there."""
    return {
        os.path.relpath(os.path.join(d, f), out)
        for d, _, files in os.walk(out)
        for f in files
        if not f.startswith("train.log.node")
    }


@pytest.mark.slow
def test_step1_two_nodes_match_one_node(cluster, tiny_gpt2, sft_data, tmp_path):  # noqa: F811
    """The two nodes are started through scripts/step1_sft/run_multi_node.sh (MULTI_NODE_MODE=no_ssh),
    which runs `deepspeed --hostfile H --no_ssh --node_rank i ... --module step1_sft.main` with its
    defaults followed by our arguments (the later flag wins), i.e. the same arguments as the 1-node run."""

    def args(out):
        return common_args(tiny_gpt2, sft_data, out, steps=4) + ["--zero_stage", 3, "--dtype", "fp32"]

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    env = base_env(MODEL=tiny_gpt2, DATA=sft_data, DTYPE="fp32")
    single, run = one_and_two_nodes(
        cluster,
        tmp_path,
        "step1_sft.main",
        args(one),
        [two, *args(two)],
        script="scripts/step1_sft/run_multi_node.sh",
        env=env,
    )
    assert os.path.exists(os.path.join(one, "model.safetensors")), single.log()[-3000:]
    assert os.path.exists(os.path.join(two, "model.safetensors")), run.logs()
    for node in run.nodes:
        log = node.log()
        assert f"--master_addr={cluster.master_addr}" in log and f"--node_rank={node.node_rank}" in log, log[-2000:]
        assert os.path.exists(os.path.join(two, f"train.log.node{node.node_rank}"))

    rows_one, rows_two = metrics(one), metrics(two)
    assert len([r for r in rows_two if "train/loss" in r]) == 4  # rank 0 alone wrote each row, once
    worst = compare_rows(rows_one, rows_two, ["train/loss", "eval/perplexity", "export/logits_max_abs_diff"])
    print(f"[multi-node] step 1 train/loss two nodes vs one node: max relative difference {worst:.2e}")
    assert output_files(two) == output_files(one)

    import torch
    from transformers import AutoModelForCausalLM

    model_one = AutoModelForCausalLM.from_pretrained(one)
    model_two = AutoModelForCausalLM.from_pretrained(two)
    assert all(p.numel() > 0 for p in model_two.parameters())  # not the empty tensors of a naive ZeRO-3 save
    state_one = model_one.state_dict()
    for name, tensor in model_two.state_dict().items():
        torch.testing.assert_close(tensor, state_one[name], rtol=1e-5, atol=1e-6)


def step3_args(model, critic, prompts, out):
    """test_step3_run's arguments, with learning rates so that the two runs really train."""
    return [
        "--actor_model_name_or_path",
        model,
        "--critic_model_name_or_path",
        critic,
        "--data_path",
        prompts,
        "--data_split",
        "0,0,10",
        "--output_dir",
        out,
        "--actor_zero_stage",
        3,
        "--critic_zero_stage",
        3,
        "--enable_hybrid_engine",
        "--dtype",
        "fp32",
        "--actor_learning_rate",
        1e-3,
        "--critic_learning_rate",
        1e-3,
        "--max_prompt_seq_len",
        32,
        "--max_answer_seq_len",
        6,
        "--per_device_generation_batch_size",
        4,
        "--per_device_training_batch_size",
        2,
        "--ppo_epochs",
        1,
        "--max_steps",
        2,
        "--seed",
        5,
    ]


@pytest.mark.slow
def test_step3_two_nodes_match_one_node(cluster, tiny_gpt2, tiny_gpt2_reward, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 40)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    single, run = one_and_two_nodes(
        cluster,
        tmp_path,
        "step3_ppo.main",
        step3_args(tiny_gpt2, tiny_gpt2_reward, prompts, one),
        step3_args(tiny_gpt2, tiny_gpt2_reward, prompts, two),
    )
    assert os.path.exists(os.path.join(one, "critic", "value_head.safetensors")), single.log()[-3000:]
    assert os.path.exists(os.path.join(two, "critic", "value_head.safetensors")), run.logs()

    rows_one, rows_two = metrics(one), metrics(two)
    assert [r["step"] for r in rows_two] == [1, 2]
    worst = compare_rows(rows_one, rows_two, ["loss/actor", "loss/critic", "reward/score_mean"])
    print(
        f"[multi-node] step 3 loss/actor, loss/critic, reward/score_mean two nodes vs one node: "
        f"max relative difference {worst:.2e}"
    )
    assert output_files(two) == output_files(one)

    from transformers import AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_pretrained(os.path.join(two, "actor"))
    assert all(p.numel() > 0 for p in actor.parameters())


def _long_step1_run(cluster, tiny_gpt2, sft_data, tmp_path):
    out = str(tmp_path / "out")
    args = common_args(tiny_gpt2, sft_data, out, steps=100000) + [
        "--zero_stage",
        3,
        "--num_train_epochs",
        1000,
        "--dist_timeout",
        DIST_TIMEOUT,
    ]
    return nodes_running(cluster, write_hostfile(tmp_path / "hostfile", cluster), "step1_sft.main", args, tmp_path), out


def _wait_for_training(run, out: str, timeout: float = 400) -> None:
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and sum('"train/loss"' in line for line in open(path)) >= 2:
            return
        run.poll()
        if any(n.ended_at is not None for n in run.nodes):
            pytest.fail(f"a node stopped before training:\n{run.logs()}")
        time.sleep(0.3)
    pytest.fail(f"no training step within {timeout} s:\n{run.logs()}")


def _survivor_stop_time(run, limit: float) -> float:
    codes = run.wait(limit)
    survivor = run.nodes[0]
    assert codes[0] is not None, f"node 0 still running {limit} s after node 1 died:\n{run.logs()}"
    assert codes[0] != 0, run.logs()
    return survivor.ended_at - run.nodes[1].killed_at


def _error_line(log: str) -> str:
    lines = [line for line in log.splitlines() if "Error" in line and "[rank0]" in line]
    return lines[-1][:300] if lines else "(no error line)"


@pytest.mark.slow
def test_killed_node_stops_the_surviving_node(cluster, tiny_gpt2, sft_data, tmp_path):  # noqa: F811
    """SIGKILL of node 1's process group (launcher and rank) mid-training: the kernel resets its TCP
    connections, gloo raises on node 0 at its next collective, rank 0 exits 1 and its launcher follows."""
    running, out = _long_step1_run(cluster, tiny_gpt2, sft_data, tmp_path)
    with running as run:
        _wait_for_training(run, out)
        run.kill_node(1)
        stopped_after = _survivor_stop_time(run, 120)
    print(
        f"\n[multi-node] node 1 SIGKILLed: node 0 exited with {run.nodes[0].proc.returncode} after "
        f"{stopped_after:.1f} s ({cluster.mode}); {_error_line(run.nodes[0].log())}"
    )
    assert stopped_after < 120


@pytest.mark.slow
def test_unreachable_node_stops_the_surviving_node_after_dist_timeout(cluster, tiny_gpt2, sft_data, tmp_path):  # noqa: F811
    """Node 1's link goes down, then node 1 is killed (a machine losing power): no reset reaches node 0,
    so only the collective timeout (`--dist_timeout`, given to deepspeed.init_distributed) ends the wait."""
    if cluster.mode != "netns":
        pytest.skip(f"needs network namespaces to cut a link ({cluster.reason})")
    running, out = _long_step1_run(cluster, tiny_gpt2, sft_data, tmp_path)
    with running as run:
        _wait_for_training(run, out)
        node = cluster.nodes[1]
        subprocess.run(["ip", "-n", node.netns, "link", "set", node.ifname, "down"], check=True)
        try:
            run.kill_node(1)
            stopped_after = _survivor_stop_time(run, DIST_TIMEOUT + 90)
        finally:
            subprocess.run(["ip", "-n", node.netns, "link", "set", node.ifname, "up"], check=False)
    error = _error_line(run.nodes[0].log())
    print(
        f"\n[multi-node] node 1 unreachable: node 0 exited with {run.nodes[0].proc.returncode} after "
        f"{stopped_after:.1f} s (--dist_timeout {DIST_TIMEOUT}); {error}"
    )
    # the survivor's one line names the rank it lost: killed (its process ended: the netns nodes share this host),
    # silent (no answer within --dist_timeout) or out of reach (another host); gloo's own wording if the store is gone
    assert re.search(
        r"error: \[rank 0\] (rank 1 \(in \w+\) is gone|no answer within --dist_timeout \d+ s from rank 1|lost the "
        r"connection to a peer rank)|Timed out|Application timeout",
        run.nodes[0].log(),
    ), run.logs()
    assert DIST_TIMEOUT - 5 < stopped_after < DIST_TIMEOUT + 90
