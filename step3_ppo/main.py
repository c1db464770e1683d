"""Step 3: RL of the step-1 policy under DeepSpeed ZeRO: PPO with a critic (GAE), or a critic-free
estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++) on several samples per prompt; rewards from step 2's
reward model and/or reward functions (`--reward_funcs`).

Which KL is which (never confused here):
- `kl/ref_mean`: KL(actor || frozen SFT reference), estimated per token (`--kl_estimator`) and
  charged inside the reward with coefficient `--kl_ctl` (fixed, or `--adaptive_kl` towards
  `--kl_target`), or as a separate loss term with `--kl_in_loss` (GRPO-style alternative);
- `ppo/approx_kl_old`, `ppo/clipfrac`, `ppo/log_ratio_max_abs`: the current actor against the
  OLD (rollout-time) actor, whose ratio the `--policy_loss` clips (`--cliprange`, `--cliprange_low`,
  `--cliprange_high`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import urllib.parse
from dataclasses import dataclass

from torch.utils.data import DataLoader, DistributedSampler

from step3_ppo.agents.flags import add_agent_args, check_agent_args
from step3_ppo.agents.loop import EnvReward, build_agent, prompts_with_tools
from step3_ppo.algo.advantages import ALIASES, ESTIMATORS, estimator_name, get_estimator
from step3_ppo.algo.shaping import AdaptiveKLController, FixedKLController
from step3_ppo.deepspeed_models import build_engines
from step3_ppo.rewards.combine import REWARD_NORMS
from step3_ppo.rewards.components import FunctionReward, RewardModelReward, reward_model_name, unique_names
from step3_ppo.rewards.functions import (
    BUILTINS,
    RewardFunctionError,
    builtins_help,
    is_function_spec,
    load_reward_function,
)
from step3_ppo.rewards.judge import JudgeReward, add_judge_args, check_judge_args
from step3_ppo.rewards.remote import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S, RemoteReward
from step3_ppo.rollout.engines import ROLLOUT_ENGINES, check_engine_args, engine_settings
from step3_ppo.teachers import add_teacher_args, check_same_tokenizer, check_teacher_args, check_teacher_column
from step3_ppo.trainer import PPOConfig, PPOTrainer
from utils.cli import Number
from utils.data import (
    PromptCollator,
    SFTCollator,
    describe_skips,
    distributed_loader,
    read_texts,
    stop_token_ids,
    tokenize_prompts,
    tokenize_texts,
)
from utils.errors import run_main
from utils.math.losses import GSPO_CLIPRANGE_HIGH, GSPO_CLIPRANGE_LOW, KL_LOSS_ESTIMATORS, POLICY_LOSSES
from utils.math.ops import KL_ESTIMATORS, LOSS_AGGREGATIONS, ROLLOUT_CORRECTIONS
from utils.models.export import export_hf_model
from utils.models.forward import check_padding_free
from utils.models.loading import check_model_path, load_tokenizer
from utils.models.reward_model import check_policy_dir, check_reward_model_dir, export_reward_model
from utils.runtime.distributed import is_rank0, rank, start_process, world_size
from utils.train.checkpoint import check_resume_early, data_layout
from utils.train.config_file import ConfigFileParser, write_run_config
from utils.train.flags import (
    add_checkpoint_args,
    add_data_args,
    add_generation_args,
    add_model_args,
    add_offload_reference_arg,
    add_output_args,
    add_training_args,
    check_sequence_fits,
    fail,
    refuse_unread,
    resolve_generation_args,
    validate_training_args,
    was_set,
)
from utils.train.loop import step_examples, total_training_steps
from utils.train.metrics_logger import print_rank0
from utils.train.run import Run

MODELS = ("actor_", "critic_")
# step 3's own defaults for the per-model flags of utils/train/flags.py (DeepSpeed-Chat's values; dropout off,
# else the rollout and training forwards of the same weights differ and the ratio at lr 0 is not 1)
MODEL_DEFAULTS = {
    "learning_rate": {"actor_": 9.65e-6, "critic_": 5e-6},
    "zero_stage": {"actor_": 3, "critic_": 3},
    "dropout": {"actor_": 0.0, "critic_": 0.0},
}


def build_parser():
    """The argument parser of this entry point (the reference pages of docs/ are generated from it)."""
    p = ConfigFileParser(description=__doc__.splitlines()[0])
    add_data_args(p)
    add_model_args(
        p,
        {
            "actor_": "step 1 output (actor and reference)",
            "critic_": "step 2 output: the critic (with gae), and the reward model unless "
            "--reward_model_name_or_path or --reward_funcs says otherwise",
        },
        MODEL_DEFAULTS,
        optional=("critic_",),
    )
    g = add_generation_args(p, do_sample=True)  # + step 3's rollout flags (DeepSpeed-Chat's names)
    g.add_argument(
        "--per_device_generation_batch_size",
        type=Number(int, low=1),
        default=4,
        help="prompts per rank per generation batch (each sampled --n_samples_per_prompt times)",
    )
    g.add_argument(
        "--generation_batches", type=Number(int, low=1), default=1, help="generation batches per PPO iteration"
    )
    g.add_argument(
        "--max_prompt_seq_len",
        type=Number(int, low=1),
        default=256,
        help="max prompt length in tokens; a longer prompt keeps its last tokens (and a chat template's header)",
    )
    g.add_argument("--max_answer_seq_len", type=Number(int, low=1), default=256, help="max new tokens per answer")
    g.add_argument("--min_answer_seq_len", type=Number(int, low=1), default=1, help="min new tokens per answer (>= 1)")
    g.add_argument(
        "--rollout_engine",
        choices=list(ROLLOUT_ENGINES),
        default="hf",
        help="what generates the rollout: " + "; ".join(f"{name}: {e.help}" for name, e in ROLLOUT_ENGINES.items()),
    )
    for entry in ROLLOUT_ENGINES.values():
        if entry.add_args is not None:
            entry.add_args(p)
    g.add_argument(
        "--max_staleness",
        type=Number(int, low=0),
        default=0,
        help="k > 0: the rollout engine generates the next iterations while this one trains, with weights at most "
        "k optimizer steps older than those the rows train under (k // one iteration's steps iterations ahead; "
        "staler rows are generated again, counted in rollout/stale_rows_regenerated); 0: synchronous. "
        "rollout/staleness_* are logged and --rollout_correction applies (engines: "
        + ", ".join(name for name, e in ROLLOUT_ENGINES.items() if e.prefetch)
        + ")",
    )
    g.add_argument(
        "--no_rollout_logprobs",
        dest="rollout_logprobs",
        action="store_false",
        help="keep no log-probs of the rollout engine for its own tokens: no rollout/logprob_diff_* "
        "metrics and no --rollout_correction, and generate holds no per-step logits (rows x tokens "
        "x vocabulary x 4 bytes less while generating)",
    )
    g.add_argument(
        "--old_logprobs",
        choices=("forward", "rollout"),
        default="forward",
        help="the old policy's log-probs that the ratio is clipped against and the KL penalty reads: "
        "forward (default): the actor's no-grad forward over the rollout; rollout: the generator's "
        "own log-probs of its tokens, no forward (veRL's bypass mode): with the hybrid engine the "
        "same weights, so the same values up to kernel rounding (lr 0: |log ratio| <= 1e-4); with "
        "another engine its distribution is the old policy",
    )
    g.add_argument(
        "--rollout_correction",
        choices=ROLLOUT_CORRECTIONS,
        default="none",
        help="weight each action's policy loss by w = pi_old / pi_rollout, the trainer's old log-prob "
        "against the generator's (a ratio of probabilities): none; tis: min(w, C); icepop: w, and 0 "
        "outside [1/C, C]; seq_mask_tis: 0 on answers whose geometric-mean w leaves [1/C, C], else "
        "min(w, C); C = --rollout_correction_threshold (default %(default)s)",
    )
    g.add_argument(
        "--rollout_correction_threshold",
        type=Number(float, above=1),
        default=2.0,
        metavar="C",
        help="C of --rollout_correction, a ratio of probabilities (> 1) (default %(default)s)",
    )
    g.add_argument(
        "--enable_hybrid_engine",
        action="store_true",
        help="generation mode: ZeRO-3 params gathered once, hooks lifted, LoRA merged; the rollout's "
        "no-grad forwards also on models gathered once (see --no_gathered_experience)",
    )
    g.add_argument(
        "--no_merge_lora_for_generation",
        dest="merge_lora_for_generation",
        action="store_false",
        help="with --enable_hybrid_engine, generate through the separate LoRA adapters instead of "
        "merging them into the base weights for the rollout",
    )
    g.add_argument(
        "--no_gathered_experience",
        dest="gathered_experience",
        action="store_false",
        help="with the hybrid engine, score the rollout through ZeRO-3's per-layer hooks instead of "
        "on models gathered whole (less memory when critic or reward model outgrow the actor)",
    )
    g.add_argument(
        "--release_inference_cache",
        action="store_true",
        help="after generation and after scoring, give the accelerator allocator's cached blocks (KV "
        "caches, gathered weights) back, so training starts from a lower peak (slower next gather)",
    )
    add_training_args(p, MODELS, MODEL_DEFAULTS)
    g = p.add_argument_group("RL")
    g.add_argument(
        "--per_device_training_batch_size",
        type=Number(int, low=1),
        default=4,
        help="PPO mini-batch size, in rows (answers) per rank",
    )
    g.add_argument(
        "--ppo_epochs",
        type=Number(int, low=1),
        default=1,
        help="passes over each rollout's mini-batches per PPO iteration",
    )
    g.add_argument(
        "--n_samples_per_prompt",
        type=Number(int, low=1),
        default=1,
        help="answers sampled per prompt (a group); --per_device_generation_batch_size counts prompts, "
        "so a rank's rollout is that x this x --generation_batches rows",
    )
    g.add_argument(
        "--advantage_estimator",
        choices=list(ESTIMATORS) + list(ALIASES),
        default="gae",
        help="; ".join(f"{name}: {e.help}" for name, e in ESTIMATORS.items())
        + "; OpenRLHF's names: "
        + ", ".join(f"{a} = {n}" for a, n in ALIASES.items()),
    )
    g.add_argument(
        "--policy_loss",
        choices=list(POLICY_LOSSES),
        default="ppo",
        help="the actor's loss: " + "; ".join(f"{name}: {e.help}" for name, e in POLICY_LOSSES.items()),
    )
    g.add_argument(
        "--loss_agg",
        choices=LOSS_AGGREGATIONS,
        default=None,
        help="token_mean (DAPO), seq_mean (GRPO), constant_norm (Dr. GRPO: sums over "
        "--max_answer_seq_len); default: the policy loss's (gspo seq_mean, cispo token_mean), else "
        "the estimator's (grpo seq_mean, dr_grpo constant_norm, else token_mean)",
    )
    g.add_argument(
        "--cliprange_low",
        type=Number(float, above=0, below=1),
        default=None,
        help="the ratio's lower clip, 1 - this (a fraction, > 0; ppo, gspo); default: --cliprange for "
        f"ppo, {GSPO_CLIPRANGE_LOW:g} for gspo (the paper's, on the sequence's mean log-ratio)",
    )
    g.add_argument(
        "--cliprange_high",
        type=Number(float, above=0),
        default=None,
        help="the ratio's upper clip, 1 + this (a fraction, > 0; DAPO's clip-higher: 0.28); cispo caps its "
        f"weight there; default: --cliprange for ppo and cispo, {GSPO_CLIPRANGE_HIGH:g} for gspo",
    )
    g.add_argument(
        "--dual_clip",
        type=Number(float, above=1),
        default=None,
        metavar="C",
        help="dual-clip: a negative-advantage action's loss is capped at -advantage x C (a ratio, > 1; "
        "OpenRLHF/veRL use 3; ppo, gspo); default: off",
    )
    g.add_argument(
        "--entropy_coef",
        type=Number(float, low=0),
        default=0.0,
        help="entropy bonus: this x the action tokens' entropy (nats per token, aggregated as the loss) "
        "is subtracted from the actor loss (>= 0; 0: only logged, ppo/entropy)",
    )
    g.add_argument("--kl_ctl", type=Number(float, low=0), default=0.1, help="initial KL(actor||reference) coefficient")
    g.add_argument("--adaptive_kl", action="store_true", help="Ziegler et al. controller towards --kl_target")
    g.add_argument(
        "--kl_target",
        type=Number(float, above=0),
        default=6.0,
        help="with --adaptive_kl: the KL(actor||reference) per answer (nats, summed over its tokens) "
        "Ziegler et al.'s controller steers --kl_ctl towards (default %(default)s)",
    )
    g.add_argument(
        "--kl_horizon",
        type=Number(float, above=0),
        default=10000,
        help="with --adaptive_kl: the controller's horizon, in answers (all ranks): each iteration "
        "moves --kl_ctl by at most 20%% x the rollout's answers / this (default %(default)s)",
    )
    g.add_argument(
        "--kl_estimator",
        choices=KL_ESTIMATORS,
        default="k1",
        help="per-token estimate of KL(actor||reference) in the reward, with r = log-ratio: "
        "k1 = r, k2 = r^2/2, k3 = exp(-r) - 1 + r (default %(default)s)",
    )
    g.add_argument(
        "--kl_in_loss",
        action="store_true",
        help="KL to the reference as a loss term (GRPO-style; its form: --kl_loss_estimator), weighted by "
        "--kl_ctl, instead of in the reward",
    )
    g.add_argument(
        "--kl_loss_estimator",
        choices=KL_LOSS_ESTIMATORS,
        default="k2",
        help="with --kl_in_loss, the per-token loss (nats) with r = log-ratio to the reference: k2 = r^2/2 "
        "x the detached ratio pi/pi_old, whose gradient is KL(pi||ref)'s; k3 = exp(-r) - 1 + r, "
        "whose gradient is KL(ref||pi)'s (biased; a warning) (default %(default)s)",
    )
    g.add_argument(
        "--clip_reward_value",
        type=Number(float, above=0),
        default=5.0,
        help="the sequence score is clipped to [-this, this] (reward units, > 0) before the KL penalty is added",
    )
    g.add_argument("--normalize_reward", action="store_true", help="score normalised by running mean/std")
    g.add_argument(
        "--gamma",
        type=Number(float, low=0, high=1),
        default=1.0,
        help="per-token discount of the returns and of GAE, in [0, 1]",
    )
    g.add_argument("--lam", type=Number(float, low=0, high=1), default=0.95, help="GAE's lambda (with gae), in [0, 1]")
    g.add_argument(
        "--no_whiten_advantages",
        dest="whiten_advantages",
        action="store_false",
        help="keep the raw advantages of the estimators that whiten them (gae, reinforce_pp, ...: "
        "mean 0, std 1 over the rollout)",
    )
    g.add_argument(
        "--cliprange",
        type=Number(float, above=0),
        default=0.2,
        help="PPO's clip of the new/old policy ratio to [1 - this, 1 + this] (a fraction, > 0): the "
        "default of --cliprange_low / --cliprange_high for ppo and cispo (gspo has its own)",
    )
    g.add_argument(
        "--cliprange_value",
        type=Number(float, above=0),
        default=0.2,
        help="the critic's new values are clipped to the rollout's values +- this (reward units, > 0)",
    )
    g.add_argument(
        "--critic_fresh_value_head",
        action="store_true",
        help="with gae: the critic may start from a plain causal LM (--critic_model_name_or_path "
        "without a value head) whose value head is new",
    )
    g.add_argument("--unsupervised_dataset_name", default=None, help="text/JSON file for the PPO-ptx loss")
    g.add_argument(
        "--unsup_coef",
        type=Number(float, low=0),
        default=27.8,
        help="weight of the PPO-ptx language-modelling loss (mean NLL per token of "
        "--unsupervised_dataset_name) added to the actor loss",
    )
    g = p.add_argument_group("rewards")
    g.add_argument(
        "--reward_model_name_or_path",
        default=None,
        help="the reward model (default: --critic_model_name_or_path, DeepSpeed-Chat's convention)",
    )
    g.add_argument(
        "--reward_funcs",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="rewards summed with --reward_weights: reward-model directories, Python functions as "
        "path/to/file.py:function or package.module:function (called with prompts, completions, "
        "completion_ids and every other field of the prompt rows as keyword lists), or "
        "built-ins: " + builtins_help().replace("%", "%%"),
    )  # argparse formats help with %
    g.add_argument(
        "--reward_weights",
        nargs="+",
        type=Number(float),
        default=None,
        help="one per reward, in order: the --reward_funcs entries, then judge, remote (--reward_url) and env",
    )
    g.add_argument(
        "--reward_norm",
        choices=REWARD_NORMS,
        default="sum_then_normalize",
        help="several rewards with a group estimator: sum_then_normalize (weighted sum, then the "
        "estimator's baseline) or normalize_then_sum (each reward z-scored in its group first, in "
        "standard deviations; GDPO, TRL's) (default %(default)s)",
    )
    g.add_argument("--format_pattern", default=None, help="the regex of the 'format' built-in")
    g.add_argument(
        "--skip_bad_rewards",
        action="store_true",
        help="a reward function that raises, times out or gives a non-finite score skips (and counts) "
        "the rows (their groups) instead of stopping the run",
    )
    g.add_argument(
        "--reward_timeout",
        type=Number(float, above=0),
        default=None,
        help="seconds a reward function call may take; then its worker process is killed (default: 120, "
        "step3_ppo/rewards/components.py's DEFAULT_REWARD_TIMEOUT_S)",
    )
    g.add_argument(
        "--reward_url",
        default=None,
        metavar="URL",
        help="a reward served over HTTP, OpenRLHF's remote reward-model convention (POST {query, prompts, labels} "
        "-> {rewards}, one request per rollout batch; labels: the rows' 'answer'): the component 'remote', after "
        "--reward_funcs in --reward_weights' order (python -m step3_ppo.rewards.server serves any reward this way)",
    )
    g.add_argument(
        "--reward_url_timeout",
        type=Number(float, above=0),
        default=DEFAULT_TIMEOUT_S,
        help="seconds --reward_url may take to answer a request before it is tried again (default %(default)s)",
    )
    g.add_argument(
        "--reward_url_retries",
        type=Number(int, low=0, high=20),
        default=DEFAULT_RETRIES,
        help="--reward_url's retries of a request that failed (no connection, timeout, HTTP 5xx or 429), waiting "
        "1, 2, 4, ... s (at most 30) between them; then the run stops, or skips the rows with "
        "--skip_bad_rewards (default %(default)s)",
    )
    g.add_argument(
        "--overlong_buffer_len",
        type=Number(int, low=0),
        default=0,
        help="DAPO's overlong penalty: answers longer than --max_answer_seq_len minus this lose up to "
        "--overlong_penalty_factor, linearly",
    )
    g.add_argument(
        "--overlong_penalty_factor",
        type=Number(float, low=0),
        default=1.0,
        help="the most DAPO's overlong penalty subtracts, reached at --max_answer_seq_len tokens (reward units)",
    )
    g.add_argument(
        "--truncation_penalty",
        type=Number(float, low=0),
        default=0.0,
        help="subtracted from the reward of answers cut at --max_answer_seq_len without EOS",
    )
    g.add_argument(
        "--mask_truncated_completions",
        action="store_true",
        help="answers cut without EOS are left out of the loss (TRL's)",
    )
    g.add_argument(
        "--filter_zero_variance_groups",
        action="store_true",
        help="groups whose rewards are all equal (no signal) are left out of the loss and counted (DAPO)",
    )
    g.add_argument(
        "--dynamic_sampling",
        action="store_true",
        help="DAPO's dynamic sampling: generate further prompt batches (one per rank per round) until each "
        "rank holds --per_device_generation_batch_size x --generation_batches groups whose rewards "
        "differ, at most --max_sampling_rounds rounds; the rest is filled with groups without signal, "
        "left out of the loss; logged as dynamic/* (groups over all ranks)",
    )
    g.add_argument(
        "--max_sampling_rounds",
        type=Number(int, low=1),
        default=4,
        help="with --dynamic_sampling, the most generation rounds of one iteration, the first included "
        "(rounds, >= 1; each further one a prompt batch per rank from the training prompts) "
        "(default %(default)s)",
    )
    add_judge_args(g)  # --judge_*: an LLM judge's verdict as the reward component 'judge' (step3_ppo/rewards/judge.py)
    g = p.add_argument_group("evaluation during training")
    g.add_argument(
        "--eval_interval",
        type=Number(int, low=0),
        default=0,
        help="evaluate before the first iteration, every K iterations and at the end (0: never)",
    )
    g.add_argument(
        "--eval_data_path",
        nargs="+",
        default=None,
        help="held-out prompt rows (default: step 3's eval split of --data_path)",
    )
    g.add_argument(
        "--eval_num_prompts", type=Number(int, low=1), default=64, help="prompts evaluated (a multiple of the ranks)"
    )
    g.add_argument("--eval_do_sample", action="store_true", help="sample the answers (default: greedy)")
    g.add_argument(
        "--per_device_eval_batch_size",
        type=Number(int, low=1),
        default=None,
        help="held-out prompts per generate call and rank (default: a rollout's rows, "
        "--per_device_generation_batch_size x --n_samples_per_prompt: the same memory)",
    )
    g = p.add_argument_group("frozen models")
    add_offload_reference_arg(g)
    g.add_argument(
        "--offload_reward_model",
        action="store_true",
        help="keep the frozen reward models' parameters in CPU memory (ZeRO-3 offload)",
    )
    g.add_argument("--enable_ema", action="store_true", help="keep an EMA of the actor, saved as actor_ema/")
    add_agent_args(p)
    add_teacher_args(p)
    add_checkpoint_args(p)
    g = add_output_args(p)
    g.add_argument(
        "--print_answers",
        action="store_true",
        help="print one prompt, its answer and score on rank 0 every --print_answers_interval iterations",
    )
    g.add_argument(
        "--print_answers_interval",
        type=Number(int, low=1),
        default=1,
        help="PPO iterations between printed answers (with --print_answers)",
    )
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    validate_args(args)
    check_resume_early(args)  # a --resume that cannot continue stops before any model loads
    return args


def validate_args(args) -> None:
    """Impossible settings stop the run here, before any model is loaded."""
    resolve_generation_args(args)
    check_policy_loss_args(args)
    check_rollout_args(args)
    check_agent_args(args)
    check_teacher_args(args)
    check_judge_args(args)  # sets args.judge (before validate_rl_args, which counts it among the rewards)
    rollout = args.per_device_generation_batch_size * args.n_samples_per_prompt * args.generation_batches
    if rollout % args.per_device_training_batch_size:
        fail(
            f"--per_device_training_batch_size {args.per_device_training_batch_size} does not divide the rollout of "
            f"{rollout} rows per rank (--per_device_generation_batch_size x --n_samples_per_prompt x "
            f"--generation_batches)"
        )
    if not 1 <= args.min_answer_seq_len <= args.max_answer_seq_len:
        fail(
            f"need 1 <= --min_answer_seq_len ({args.min_answer_seq_len}) <= --max_answer_seq_len "
            f"({args.max_answer_seq_len})"
        )
    validate_rl_args(args)
    refuse_unread_flags(args)
    check_model_path(args.actor_model_name_or_path, "--actor_model_name_or_path")
    check_policy_dir(args.actor_model_name_or_path, "--actor_model_name_or_path")
    if args.critic_model_name_or_path:
        check_model_path(args.critic_model_name_or_path, "--critic_model_name_or_path")
        # as the critic (a reward model, unless --critic_fresh_value_head); as a reward model it is checked below
        if get_estimator(args.advantage_estimator).needs_critic and not args.critic_fresh_value_head:
            check_reward_model_dir(args.critic_model_name_or_path, "--critic_model_name_or_path")
    for path in args.reward_model_paths:
        flag = (
            "--reward_funcs"
            if args.reward_funcs
            else "--reward_model_name_or_path"
            if args.reward_model_name_or_path
            else "--critic_model_name_or_path"
        )
        if args.reward_funcs and not os.path.isdir(os.path.expanduser(path)) and "/" not in path:
            fail(
                f"--reward_funcs {path!r} is none of: a built-in ({', '.join(BUILTINS)}), path/to/file.py:function, "
                f"package.module:function, a reward-model directory"
            )
        check_model_path(path, flag)
        check_reward_model_dir(path, flag if flag == "--critic_model_name_or_path" else f"{flag} reward model")
    if args.unsupervised_dataset_name and not os.path.exists(args.unsupervised_dataset_name):
        fail(f"--unsupervised_dataset_name {args.unsupervised_dataset_name!r} does not exist")
    for path in dict.fromkeys(
        [args.actor_model_name_or_path, args.critic_model_name_or_path, *args.reward_model_paths]
    ):
        if path:
            response = "max_trajectory_len" if args.env or args.tools else "max_answer_seq_len"  # a row's response
            check_sequence_fits(
                path, args.max_prompt_seq_len + getattr(args, response), f"--max_prompt_seq_len + --{response}"
            )
    validate_training_args(args, MODELS)  # last: it checks OUTPUT_DIR


def refuse_unread_flags(args) -> None:
    """A flag set to a value the run never reads stops it (it would silently do nothing): the critic's flags without
    a critic, a controller's or a loss term's settings without it, another engine's flags."""
    if not get_estimator(args.advantage_estimator).needs_critic:
        reads = {"critic_model_name_or_path"} | ({"critic_zero_stage"} if args.reward_model_paths else set())
        critic = [a for a in vars(args) if a.startswith("critic_") and a not in reads]  # the reward models' stage
        refuse_unread(
            args,
            [*critic, "cliprange_value", "lam"],
            f"with --advantage_estimator {args.advantage_estimator} (no critic)",
        )
    if not args.adaptive_kl:
        refuse_unread(args, ["kl_target", "kl_horizon"], "without --adaptive_kl")
    if not args.unsupervised_dataset_name:
        refuse_unread(args, ["unsup_coef"], "without --unsupervised_dataset_name")
    if not args.dynamic_sampling:
        refuse_unread(args, ["max_sampling_rounds"], "without --dynamic_sampling")
    if args.rollout_correction == "none":
        refuse_unread(args, ["rollout_correction_threshold"], "without --rollout_correction")
    if not args.overlong_buffer_len:
        refuse_unread(args, ["overlong_penalty_factor"], "without --overlong_buffer_len")
    if not args.print_answers:
        refuse_unread(args, ["print_answers_interval"], "without --print_answers")
    if args.reward_url is None:
        refuse_unread(args, ["reward_url_timeout", "reward_url_retries"], "without --reward_url")


def check_rollout_args(args) -> None:
    """--dynamic_sampling compares the answers to a prompt; --rollout_correction and --old_logprobs rollout need
    the generator's own log-probs (an engine that gives them, not turned off), the correction C > 1 and the
    forward's old log-probs; the chosen engine checks its own flags."""
    check_engine_args(args)
    if args.max_staleness:
        if not ROLLOUT_ENGINES[args.rollout_engine].prefetch:
            ahead = ", ".join(name for name, e in ROLLOUT_ENGINES.items() if e.prefetch)
            fail(f"--max_staleness: --rollout_engine {args.rollout_engine} cannot generate ahead (use {ahead})")
        if args.dynamic_sampling or args.env or args.tools:
            fail(
                "--max_staleness generates later iterations' prompts ahead in one round each; it does not combine "
                "with --dynamic_sampling or multi-turn rollouts (--env/--tools)"
            )
    if args.dynamic_sampling and args.n_samples_per_prompt < 2:
        fail(
            f"--dynamic_sampling keeps the prompts whose answers' rewards differ: it needs --n_samples_per_prompt "
            f">= 2, got {args.n_samples_per_prompt}"
        )
    if args.old_logprobs == "rollout":
        if not ROLLOUT_ENGINES[args.rollout_engine].logprobs or not args.rollout_logprobs:
            fail(
                "--old_logprobs rollout reads the generator's log-probs, which "
                + (
                    f"--rollout_engine {args.rollout_engine} does not give"
                    if args.rollout_logprobs
                    else "--no_rollout_logprobs leaves out"
                )
            )
        processed = ROLLOUT_ENGINES[args.rollout_engine].processed_logprobs
        if processed and args.do_sample and (args.top_k > 0 or args.top_p < 1):
            fail(
                f"--old_logprobs rollout with --rollout_engine {args.rollout_engine} --top_k {args.top_k} --top_p "
                f"{args.top_p}: the generator's log-probs are "
                "of the truncated distribution it sampled, not of the policy trained (softmax(logits / T)), so the "
                "PPO ratio would not start at 1; use --old_logprobs forward"
            )
        if args.rollout_correction != "none":
            fail(
                f"--rollout_correction {args.rollout_correction} weighs the forward's old log-probs against the "
                f"generator's; with --old_logprobs rollout they are the same (every weight 1)"
            )
    longest = args.max_prompt_seq_len + args.max_answer_seq_len
    if args.max_tokens_per_micro_batch and args.max_tokens_per_micro_batch < longest and not (args.env or args.tools):
        fail(
            f"--max_tokens_per_micro_batch {args.max_tokens_per_micro_batch} is below --max_prompt_seq_len + "
            f"--max_answer_seq_len = {longest}: a rollout row could be longer than a micro-batch may hold"
        )
    if args.rollout_correction == "none":
        return
    if not ROLLOUT_ENGINES[args.rollout_engine].logprobs:
        fail(
            f"--rollout_correction {args.rollout_correction}: --rollout_engine {args.rollout_engine} gives no "
            f"log-probs of its tokens"
        )
    if not args.rollout_logprobs:
        fail(
            f"--rollout_correction {args.rollout_correction} needs the generator's log-probs, which "
            f"--no_rollout_logprobs leaves out"
        )


def check_policy_loss_args(args) -> None:
    """A setting the chosen --policy_loss does not read stops the run (it would silently do nothing);
    --dual_clip must exceed 1; the k3 KL loss prints its bias."""
    entry = POLICY_LOSSES[args.policy_loss]
    for name in sorted(set().union(*(e.options for e in POLICY_LOSSES.values())) - set(entry.options)):
        if was_set(args, name):
            readers = [n for n, e in POLICY_LOSSES.items() if name in e.options]
            fail(f"--{name} does nothing with --policy_loss {args.policy_loss} (it is read by {', '.join(readers)})")
    if "cliprange_low" in entry.options and args.cliprange_low is None and args.cliprange >= 1:
        fail(
            f"--cliprange {args.cliprange:g} makes the ratio's lower clip 1 - {args.cliprange:g} <= 0, which never "
            f"clips: give a fraction below 1 (or --cliprange_low for the lower side)"
        )
    if args.kl_in_loss and args.kl_loss_estimator == "k3":
        print_rank0(
            "[step3] warning: --kl_loss_estimator k3 as a loss has a biased gradient: its expectation is "
            "the gradient of KL(reference || actor), not of KL(actor || reference) (k2 is unbiased)"
        )


def validate_rl_args(args) -> None:
    """The estimator, samples per prompt, rewards and length shaping; sets `args.reward_specs` (the
    run's rewards, in order), `args.reward_model_paths` (the reward-model directories among them) and
    resolves an OpenRLHF alias to its estimator."""
    args.advantage_estimator = estimator_name(args.advantage_estimator)
    estimator = get_estimator(args.advantage_estimator)
    for path in args.eval_data_path or []:
        if not os.path.exists(path):
            fail(f"--eval_data_path {path!r} does not exist")
    if estimator.groups and args.n_samples_per_prompt < 2:
        fail(
            f"--advantage_estimator {args.advantage_estimator} compares the answers to one prompt: "
            f"it needs --n_samples_per_prompt >= 2, got {args.n_samples_per_prompt}"
        )
    if args.n_samples_per_prompt > 1 and not args.do_sample:
        fail("--n_samples_per_prompt > 1 needs sampling (without --do_sample every answer to a prompt is the same)")
    if args.overlong_buffer_len >= args.max_answer_seq_len:
        fail(
            f"--overlong_buffer_len {args.overlong_buffer_len} must be below --max_answer_seq_len "
            f"{args.max_answer_seq_len}"
        )
    env_reward = args.environment is not None and args.environment.has_reward  # the component `env`, last
    given = args.reward_funcs or ([args.reward_model_name_or_path] if args.reward_model_name_or_path else [])
    judged = args.judge is not None  # the component `judge`, after the --reward_funcs entries (before `env`)
    remote = args.reward_url is not None  # the component `remote`, after `judge` (before `env`)
    if remote and urllib.parse.urlsplit(args.reward_url).scheme not in ("http", "https"):
        fail(f"--reward_url must be an http:// or https:// URL, got {args.reward_url!r}")
    specs = args.reward_specs = given or ([] if env_reward or judged or remote else [args.critic_model_name_or_path])
    if specs == [None] and args.teachers:
        specs = args.reward_specs = []  # distillation alone: the teachers' signal is the only one
    if specs == [None]:
        fail(
            "no reward: give --reward_funcs, --reward_model_name_or_path, --critic_model_name_or_path, "
            "--judge_model_name_or_path or --reward_url (or --teacher_model_name_or_path to distil)"
        )
    names = specs + (["judge"] if judged else []) + (["remote"] if remote else []) + (["env"] if env_reward else [])
    if args.reward_weights is not None and len(args.reward_weights) != len(names):
        fail(f"--reward_weights has {len(args.reward_weights)} values for {len(names)} rewards ({' '.join(names)})")
    args.reward_model_paths = [spec for spec in specs if not is_function_spec(spec)]
    if estimator.needs_critic and not args.critic_model_name_or_path:
        fail(
            f"--advantage_estimator {args.advantage_estimator} trains a critic: give --critic_model_name_or_path "
            f"(a step-2 reward model, or a causal LM with --critic_fresh_value_head), or choose a critic-free "
            f"estimator ({', '.join(n for n, e in ESTIMATORS.items() if not e.needs_critic)})"
        )
    if args.critic_fresh_value_head and not estimator.needs_critic:
        fail(f"--critic_fresh_value_head: --advantage_estimator {args.advantage_estimator} has no critic")
    if args.reward_norm == "normalize_then_sum" and not estimator.groups:
        fail(
            f"--reward_norm normalize_then_sum normalises each reward within a prompt's group: --advantage_estimator "
            f"{args.advantage_estimator} has no groups (choose one of "
            f"{', '.join(n for n, e in ESTIMATORS.items() if e.groups)})"
        )


def load_reward_functions(args) -> dict:
    """The reward functions of --reward_funcs by spec, loaded (and so checked) before any model is."""
    functions = {}
    for spec in filter(is_function_spec, args.reward_specs):
        try:
            functions[spec] = load_reward_function(spec, **vars(args))  # a built-in takes the options it declares
        except RewardFunctionError as e:
            fail(f"--reward_funcs: {e}")
    return functions


def build_rewards(args, tokenizer, engines, functions: dict) -> list:
    """The reward components, in --reward_funcs order (or the one reward model); `functions` by spec."""
    several = len(args.reward_model_paths) > 1
    components = []
    for spec in args.reward_specs:
        if spec in functions:
            components.append(FunctionReward(functions[spec], tokenizer, args.reward_timeout, args.skip_bad_rewards))
        else:
            components.append(
                RewardModelReward(
                    engines.rewards[spec],
                    tokenizer.pad_token_id,
                    reward_model_name(spec) if several else "reward_model",
                )
            )
    if getattr(args, "judge", None) is not None:  # the LLM judge (--judge_model_name_or_path), on its own engine
        components.append(JudgeReward(engines.judge, args.judge, tokenizer, args.judge_batch_size))
    if args.reward_url is not None:  # a reward served over HTTP (--reward_url)
        components.append(
            RemoteReward(
                args.reward_url, tokenizer, args.reward_url_timeout, args.reward_url_retries, args.skip_bad_rewards
            )
        )
    if args.environment is not None and args.environment.has_reward:
        components.append(EnvReward())
    unique_names(components)
    return components


def kl_controller(args):
    if args.adaptive_kl:
        return AdaptiveKLController(args.kl_ctl, args.kl_target, args.kl_horizon)
    return FixedKLController(args.kl_ctl)


def unsupervised_batches(args, tokenizer):
    """Endless shuffled batches of pretraining text for the PPO-ptx term (None without a dataset)."""
    if not args.unsupervised_dataset_name:
        return None
    examples, stats = tokenize_texts(
        read_texts(args.unsupervised_dataset_name), tokenizer, args.max_prompt_seq_len + args.max_answer_seq_len
    )
    print_rank0(f"[step3] unsupervised (ptx) examples {len(examples)} {stats}")
    sampler, loader = distributed_loader(
        examples, args.per_device_training_batch_size, SFTCollator(tokenizer.pad_token_id), args.seed, drop_last=True
    )

    def forever():
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from loader

    return forever()


@dataclass
class Setup:
    args: argparse.Namespace
    tokenizer: object
    sampler: DistributedSampler
    loader: DataLoader
    engines: object
    trainer: PPOTrainer
    steps_per_epoch: int
    total_steps: int
    eval_batches: list  # this rank's held-out prompt batches (empty without --eval_interval)


def setup(args) -> Setup:
    """Everything before the first PPO iteration: process group, tokenizer, prompts, engines, trainer."""
    start_process(args)
    functions = load_reward_functions(args)
    tokenizer = load_tokenizer(
        args.actor_model_name_or_path, args.trust_remote_code, padding_side="left", chat_template=args.chat_template
    )
    if args.teachers:
        check_same_tokenizer(args, tokenizer)
    critic = [args.critic_model_name_or_path] if get_estimator(args.advantage_estimator).needs_critic else []
    for path in dict.fromkeys(critic + args.reward_model_paths):
        other = load_tokenizer(path, args.trust_remote_code)
        if len(other) != len(tokenizer) or other.eos_token_id != tokenizer.eos_token_id:
            fail(
                f"the actor's tokenizer ({args.actor_model_name_or_path}, {len(tokenizer)} tokens) "
                f"and that of {path} ({len(other)} tokens) differ"
            )

    def tokenize(rows):  # with --tools, each prompt offers them (the template's tools, or the project's block)
        rows, schemas = prompts_with_tools(rows, tokenizer, args.tool_list)
        return tokenize_prompts(rows, tokenizer, args.max_prompt_seq_len, tools=schemas)

    settings = {
        "max_prompt_seq_len": args.max_prompt_seq_len,
        **({"tools": [t.schema for t in args.tool_list]} if args.tool_list else {}),
    }
    split_eval = args.eval_interval > 0 and not args.eval_data_path
    prompts, stats, eval_prompts, _ = step_examples(args, tokenizer, 3, tokenize, settings, with_eval=split_eval)
    print_rank0(f"[step3] prompts {len(prompts)} {stats}")
    if args.eval_interval and args.eval_data_path:
        eval_args = argparse.Namespace(
            **{**vars(args), "data_path": args.eval_data_path, "data_split": "0,0,1", "eval_fraction": 0.0}
        )
        eval_prompts = step_examples(eval_args, tokenizer, 3, tokenize, settings, with_eval=False)[0]
    check_teacher_column([*prompts, *(eval_prompts or [])], args.teacher_key, [t.name for t in args.teachers])
    if not prompts and stats["skipped"]:
        fail(
            f"every prompt was skipped ({describe_skips(stats['skipped'])}); too_long: not even "
            f"the chat template's frame fits --max_prompt_seq_len {args.max_prompt_seq_len}"
        )
    sampler, loader = distributed_loader(
        prompts,
        args.per_device_generation_batch_size,
        PromptCollator(tokenizer.pad_token_id),
        args.seed,
        drop_last=True,
    )
    steps_per_epoch = len(loader) // args.generation_batches
    if steps_per_epoch == 0:
        fail(
            f"{len(prompts)} prompts are too few for one PPO iteration of "
            f"{args.per_device_generation_batch_size} x {args.generation_batches} per rank on "
            f"{world_size()} ranks"
        )
    total_steps = total_training_steps(steps_per_epoch * args.num_train_epochs, args)
    engines = build_engines(args, tokenizer, total_steps, args.reward_model_paths)
    if args.padding_free:
        for engine in (engines.actor, engines.critic):
            if engine is not None:
                check_padding_free(engine)
    if (args.env or args.tools) and not stats["chat"]:
        fail(
            "--env/--tools need conversational prompts (message lists, or --apply_chat_template): "
            "turns and replies are rendered by the chat template"
        )
    stop_ids = stop_token_ids(tokenizer, chat=stats["chat"])
    print_rank0(f"[step3] responses end at {tokenizer.convert_ids_to_tokens(stop_ids)}")
    config = PPOConfig.from_args(
        args,
        stop_token_ids=tuple(stop_ids),
        pad_token_id=tokenizer.pad_token_id,
        reward_weights=tuple(args.reward_weights) if args.reward_weights else None,
        engine_settings=engine_settings(args),
    )
    trainer = PPOTrainer(
        engines,
        config,
        kl_controller(args),
        build_rewards(args, tokenizer, engines, functions),
        unsupervised_batches(args, tokenizer),
        agent=build_agent(args, tokenizer),
    )
    if not ROLLOUT_ENGINES[args.rollout_engine].logprobs:
        print_rank0(
            f"[step3] --rollout_engine {args.rollout_engine} gives no log-probs of its tokens: "
            f"rollout/logprob_diff_* are not logged"
        )
    return Setup(
        args,
        tokenizer,
        sampler,
        loader,
        engines,
        trainer,
        steps_per_epoch,
        total_steps,
        eval_batches(args, eval_prompts, tokenizer) if args.eval_interval else [],
    )


def eval_batches(args, examples: list, tokenizer) -> list:
    """This rank's share of the first --eval_num_prompts held-out prompts, in batches; every rank gets
    as many batches (ZeRO-3 generation is collective), so the count is cut to a multiple of the ranks."""
    ranks = world_size()
    count = min(args.eval_num_prompts, len(examples)) // ranks * ranks
    if count == 0:
        fail(
            f"--eval_interval: {len(examples)} held-out prompts are too few for {ranks} ranks "
            f"(give --eval_data_path, or raise --eval_fraction)"
        )
    mine = examples[:count][rank() :: ranks]
    # by default as many rows per generate call as a rollout's (its prompts x samples): the same memory
    size = args.per_device_eval_batch_size or args.per_device_generation_batch_size * args.n_samples_per_prompt
    collate = PromptCollator(tokenizer.pad_token_id)
    print_rank0(
        f"[step3] evaluation: {count} held-out prompts every {args.eval_interval} iterations"
        f" ({'sampled' if args.eval_do_sample else 'greedy'})"
    )
    return [collate(mine[i : i + size]) for i in range(0, len(mine), size)]


def checkpointed_engines(engines) -> dict:
    """The engines whose state changes during PPO (the reference and reward model are frozen)."""
    named = {"actor": engines.actor}
    if engines.critic is not None:
        named["critic"] = engines.critic
    if engines.ema is not None:
        named["actor_ema"] = engines.ema.engine
    return named


def train(prepared: Setup) -> Run:
    """PPO iterations until --max_steps or the end of --num_train_epochs (resuming with --resume);
    evaluations before the first, every --eval_interval and after the last. Returns the finished Run."""
    args, trainer = prepared.args, prepared.trainer
    evaluate = (
        (lambda step: trainer.evaluate(prepared.eval_batches, args.eval_do_sample)) if prepared.eval_batches else None
    )
    run = Run(
        args,
        "step3",
        "step3 ppo",
        checkpointed_engines(prepared.engines),
        data_layout(args, len(prepared.loader.dataset)),
        prepared.total_steps,
        memory=trainer.memory,
        evaluate=evaluate,
        evaluate_last=True,
    )
    run.restore(lambda: ({}, evaluate(0) if evaluate else {}))
    if run.resumed:
        trainer.kl_ctl.load_state_dict(run.state["kl_ctl"])
        trainer.reward_moments.load_state_dict(run.rank_state["reward_moments"])
    trainer.guard = run.guard
    for prompt_batches in run.steps(prepared.loader, prepared.sampler, args.generation_batches):
        # dynamic sampling draws further prompt batches from the same loader (a resume skips them too)
        metrics, rollout = trainer.step(
            prompt_batches,
            run.loop.step,
            more_prompts=run.next_batch,
            next_prompts=lambda ahead: run.peek(args.generation_batches, ahead),
        )
        if metrics.get("dynamic/missing_groups"):
            print_rank0(
                f"[step3] step {run.loop.step + 1}: {metrics['dynamic/missing_groups']:.0f} groups with "
                f"signal missing after {metrics['dynamic/rounds']} sampling rounds (--max_sampling_rounds); "
                f"trained on the {metrics['dynamic/kept_groups']:.0f} kept"
            )
        run.loop.overflow_steps += int(metrics.get("train/overflow_skipped", 0))
        shown = {
            "score": f"{metrics.get('reward/score_mean', float('nan')):.3f}",
            "kl": f"{metrics.get('kl/ref_mean', float('nan')):.3f}",
        }
        run.after_step(
            metrics,
            lambda evaluation: {
                **shown,
                **({"eval_acc": f"{evaluation['eval/accuracy']:.3f}"} if "eval/accuracy" in evaluation else {}),
            },
            state={"kl_ctl": trainer.kl_ctl.state_dict()},
            rank_state={"reward_moments": trainer.reward_moments.state_dict()},
        )
        if args.print_answers and run.loop.step % args.print_answers_interval == 0:
            _print_answer(prepared.tokenizer, rollout[0], run.loop.step)
    return run


def export(prepared: Setup) -> None:
    """actor/ (and critic/, actor_ema/ when the run has them) under --output_dir."""
    engines, out = prepared.engines, prepared.args.output_dir
    export_hf_model(engines.actor, prepared.tokenizer, os.path.join(out, "actor"))
    if engines.critic is not None:
        export_reward_model(engines.critic, prepared.tokenizer, os.path.join(out, "critic"))
    if engines.ema is not None:
        export_hf_model(engines.ema.engine, prepared.tokenizer, os.path.join(out, "actor_ema"))


def main(argv=None):
    args = parse_args(argv)
    write_run_config(args, "step3_ppo.main")  # OUTPUT_DIR/config.yaml (rank 0): `--config` it to rerun these flags
    prepared = setup(args)
    try:
        run = train(prepared)  # a RewardFunctionError on any rank is shown once, by run_main (utils/errors.py)
    finally:
        prepared.trainer.rollout.close()
        for teacher in prepared.engines.teachers.values():  # a teacher on its own vLLM worker ends with the run
            getattr(teacher, "close", lambda: None)()
    print_rank0(f"[step3] {run.loop.step} PPO iterations in {run.train_s:.1f} s (evaluations {run.eval_s:.1f} s)")
    engines = prepared.engines
    saved = ["actor/"] + ["critic/"] * (engines.critic is not None) + ["actor_ema/"] * (engines.ema is not None)
    run.finish(lambda: export(prepared), args.output_dir, " and ".join(saved))


def _print_answer(tokenizer, row, step: int) -> None:
    if not is_rank0():
        return
    prompt = tokenizer.decode(row.prompt_ids, skip_special_tokens=True)
    answer = tokenizer.decode(row.response_ids, skip_special_tokens=True)
    print(
        f"\n[step3 {step}] prompt: {prompt!r}\n[step3 {step}] answer: {answer!r}"
        f"\n[step3 {step}] score: {row.score:.3f}",
        flush=True,
    )


def cli() -> None:
    """`python -m step3_ppo.main` and the `rlhf-rl` command: main() ended by run_main (the project's errors as one
    `error:` line)."""
    run_main(main)


if __name__ == "__main__":
    cli()
