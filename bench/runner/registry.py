"""Every benchmark of bench/, one entry each: `python -m bench list` prints this registry, `python -m bench run NAME`
runs an entry, bench/README.md's table is generated from it, and tests/test_bench.py fails when a bench/ entry point
is missing from it (so a new benchmark cannot go unlisted)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: `module` (run as `python -m module`) or `script` (a bash script, from the repository root);
    `tiny`: the arguments of its tiny form (None: it has none); `minutes`: estimated wall minutes (tiny, full) on the
    2-core CPU machine; `takes_save`: it writes its own report with `--save FILE` (otherwise the runner keeps its
    output); `headline`: a regular expression whose first match in the report is its headline figure; `files`:
    the benchmark's other files under bench/."""

    name: str
    what: str
    minutes: tuple[float | None, float]
    module: str | None = None
    script: str | None = None
    tiny: tuple[str, ...] | None = ("--tiny",)
    takes_save: bool = True
    headline: str = ""
    files: tuple[str, ...] = ()

    def command(self, python: str) -> list[str]:
        """The command line of the full form, without extra arguments."""
        return [python, "-m", self.module] if self.module else ["bash", self.script]

    def entry_point(self) -> str:
        """The file that runs it, relative to the repository root."""
        return self.script or self.module.replace(".", "/") + ".py"


BENCHMARKS = (
    Benchmark(
        "generation",
        "the actor's generation modes (plain ZeRO-3, hybrid) vs the unsharded limit, tokens/s",
        (1, 9),
        module="bench.generation",
        headline=r"hybrid/unsharded[^,;)]*",
    ),
    Benchmark(
        "step3",
        "PPO iterations of the real step 3, ZeRO-2/3 x hybrid on/off: s/iteration and its split",
        (4, 10),
        module="bench.step3",
    ),
    Benchmark(
        "profile_step3",
        "torch.profiler of one rollout's PPO updates (rank 0): operators by CPU time",
        (2, 4),
        module="bench.profile_step3",
    ),
    Benchmark(
        "zero3_trace",
        "what a no-grad forward of a ZeRO-3 engine costs the training steps after it",
        (1, 3),
        module="bench.zero3_trace",
    ),
    Benchmark(
        "memory_step3",
        "where a step-3 rank's memory goes: by model, by phase, the allocator",
        (1, 3),
        module="bench.memory_step3",
    ),
    Benchmark(
        "distill",
        "one on-policy distillation iteration vs one GRPO iteration on the same rollout: s per phase, peak memory",
        (1, 8),
        module="bench.distill",
        headline=r"reverse_kl_sampled +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+x",
    ),
    Benchmark(
        "memory_dpo",
        "peak per rank and s/step of two step-2 losses (sigmoid vs simpo), alternating",
        (1, 12),
        module="bench.memory_dpo",
    ),
    Benchmark(
        "peer_trl",
        "our step 3 vs TRL 1.12.0's PPO trainer, same workload (needs bench/.venv-trl)",
        (4, 7),
        module="bench.peer_trl",
        headline=r"ratio ours/TRL samples/s[^(]*",
        files=("requirements.txt",),
    ),
    Benchmark(
        "peer_trl_grpo",
        "our GRPO vs TRL 1.16.0's GRPOTrainer, same workload (needs bench/.venv-trl-grpo)",
        (3, 10),
        module="bench.peer_trl_grpo",
        headline=r"ratio ours/TRL samples/s over .*",
        files=("requirements-grpo.txt",),
    ),
    Benchmark(
        "response_head",
        "the LM head over the trained positions only (logits_to_keep) vs the whole sequence",
        (0.2, 7),
        module="bench.response_head",
    ),
    Benchmark(
        "chunked_logprobs",
        "peak memory of an actor step's log-prob forward + backward: the LM head in chunks vs the whole logits",
        (2, 10),
        module="bench.chunked_logprobs",
        headline=r"chunked \([^)]*\) / whole peak: [0-9.]+",
    ),
    Benchmark(
        "sft_throughput",
        "the real step 1's training tokens/s and MFU (6N vs the matmul probe) per layout, and a profiled step",
        (1, 15),
        module="bench.sft_throughput",
        headline=r"best MFU: [0-9.]+% \([^,]*",
    ),
    Benchmark(
        "vllm_engine",
        "step 3's rollout engines on one ZeRO-3 actor: hybrid HF generate vs the vLLM worker",
        (3, 10),
        module="bench.vllm_engine",
    ),
    Benchmark(
        "vllm_sync",
        "step 3's vLLM weight sync with LoRA, the adapter alone vs the merged model, and --max_staleness 0/1/2",
        (3, 15),
        module="bench.vllm_sync",
        headline=r"bytes per sync merged / adapter: [0-9.]+x",
    ),
    Benchmark(
        "optimizer_step",
        "one AdamW step over a SmolLM2-sized ZeRO partition: for-loop, foreach, fused",
        (0.1, 0.5),
        module="bench.optimizer_step",
        tiny=("--params", "6.7e6", "--repeats", "2"),
        takes_save=False,
        headline=r"fused over foreach.*",
    ),
    Benchmark(
        "data_hash",
        "the resume check's sha256 of the demo's data files (one pass, best of 5)",
        (0.1, 0.1),
        module="bench.data_hash",
        tiny=(),
        takes_save=False,
        headline=r"sha256 of .*",
    ),
    Benchmark(
        "sandbox_startup",
        "the python tool's per-call start-up (bubblewrap) vs a plain python subprocess, median and p90 ms",
        (0.1, 0.2),
        module="bench.sandbox_startup",
        tiny=("--calls", "5"),
        takes_save=False,
        headline=r"sandbox start-up: .*",
    ),
    Benchmark(
        "data_cache",
        "tokenising an SFT data set once (--data_output_path), then reading it back",
        (0.2, 1),
        module="bench.data_cache",
        tiny=("--rows", "2000"),
        takes_save=False,
    ),
    Benchmark(
        "preference_losses",
        "the demo's steps 1-2, then DPO, SimPO and ORPO and one evaluation of the three",
        (None, 50),
        script="bench/preference_losses.sh",
        tiny=None,
        takes_save=False,
    ),
    Benchmark(
        "gpu",
        "the one prepared one-GPU check: steps 1-3, lr=0, single-GPU scripts, generation",
        (4, 6),
        script="bench/gpu.sh",
        tiny=("--mode", "cpu"),
        files=("gpu_run.py", "gpu_prepare.sh"),
    ),
    Benchmark(
        "demo",
        "scripts/demo.sh end to end (--quick: tiny models); pass --task for the other demos",
        (1.5, 20),
        script="scripts/demo.sh",
        tiny=("--quick",),
        takes_save=False,
    ),
)
REGISTRY = {b.name: b for b in BENCHMARKS}
