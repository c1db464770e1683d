"""The DeepSpeed engines of step 3 (and the optional EMA of the actor); only those the run needs.

actor     causal LM from step 1, trained           (--actor_zero_stage, LoRA, optimizer)
reference causal LM from step 1, frozen            (ZeRO-3 when the actor is, else stage 0; with
                                                   --offload_reference_model ZeRO-3 with its
                                                   parameters in CPU memory, whatever the actor's stage;
                                                   only with a KL term: --kl_ctl > 0)
critic    RewardModel from step 2, trained         (--critic_zero_stage, LoRA, optimizer; only when the
                                                   advantage estimator needs one; from a plain causal
                                                   LM with a fresh value head only when asked:
                                                   --critic_fresh_value_head)
rewards   RewardModels from step 2, frozen         (ZeRO-3 when the critic is, else stage 0;
                                                   --offload_reward_model as the reference's): one per
                                                   reward-model directory of the run's rewards
teachers  causal LMs, frozen                       (as the reference, --offload_teacher_model): one per
                                                   --teacher_model_name_or_path (step3_ppo/teachers.py); with
                                                   --teacher_engine vllm each a client of its own vLLM worker
                                                   instead (step3_ppo/rollout/vllm_teacher.py)
judge     causal LM, frozen, its own tokenizer     (as the reference, --offload_judge_model): the LLM judge of
                                                   the reward component 'judge' (step3_ppo/rewards/judge.py)
With --load_in_4bit (QLoRA) the base weights of the frozen models (reference, reward models, teachers, the EMA) and
of an actor/critic trained through LoRA with --only_optimize_lora are NF4 (check_qlora_args refuses the rest); value
heads, LM heads, embeddings and the adapters keep the engine's --dtype.
Dropout is off by default in all of them: with dropout the rollout and training forwards of the
same weights differ, and the PPO ratio at learning rate 0 is no longer 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from step3_ppo.algo.advantages import needs_critic
from step3_ppo.rollout.engines import ROLLOUT_ENGINES
from utils.models.loading import ModelFlagError, check_4bit_args, four_bit_loading, load_causal_lm
from utils.models.reward_model import RewardModel
from utils.runtime.distributed import is_rank0, world_size
from utils.train.ds_config import eval_ds_config, train_ds_config
from utils.train.loop import add_lora, build_frozen_engine, build_trained_engine, initialize_engine, spec_from_args


@dataclass
class Engines:
    actor: object
    ref: object | None  # None without a KL term
    critic: object | None  # None when the advantage estimator needs no critic
    rewards: dict  # reward-model path -> its frozen engine (empty for function rewards only)
    ema: "ActorEMA | None" = None
    # teacher name -> its frozen engine (--teacher_model_name_or_path), or its VLLMTeacher (--teacher_engine vllm)
    teachers: dict = field(default_factory=dict)
    judge: object | None = None  # the LLM judge's frozen engine (--judge_model_name_or_path)


class ActorEMA:
    """Exponential moving average of the actor's weights, kept in a frozen engine (ZeRO-3 when the actor is).

    Under ZeRO-3 each parameter pair is gathered, averaged on rank 0 and re-partitioned
    (GatheredParameters with modifier_rank=0 broadcasts rank 0's result).
    """

    def __init__(self, engine, beta: float = 0.992):
        self.engine, self.beta = engine, beta

    @torch.no_grad()
    def update(self, actor_engine) -> None:
        import deepspeed  # lazy: +0.5 s on every --help (deepspeed)

        zero3 = actor_engine.zero_optimization_stage() == 3
        pairs = zip(self.engine.module.named_parameters(), actor_engine.module.named_parameters())
        for (ema_name, ema_param), (name, param) in pairs:
            if ema_name != name:
                raise RuntimeError(f"EMA and actor parameters differ: {ema_name} vs {name}")
            if not param.is_floating_point():  # 4-bit base weights (--load_in_4bit): frozen, equal in both
                continue
            with deepspeed.zero.GatheredParameters([ema_param, param], modifier_rank=0, enabled=zero3):
                if not zero3 or is_rank0():
                    ema_param.data.copy_(torch.lerp(param.data.to(ema_param.dtype), ema_param.data, self.beta))


def needs_reference(args) -> bool:
    """A frozen reference is needed only for a KL term (in the reward or in the loss)."""
    return args.kl_ctl > 0


def check_qlora_args(args, reward_model_paths=()) -> None:
    """--load_in_4bit: refuse, one line each, what 4-bit base weights cannot do here, before a model loads: a trained
    model's full fine-tuning, --dtype fp16, a 4-bit model at ZeRO stage 3 (incl. --offload_reference_model /
    --offload_reward_model, which are ZeRO-3 offload), and merging LoRA into 4-bit weights for the hybrid rollout."""
    if not args.load_in_4bit:
        return
    trained = {"actor": "actor_"}
    stages = {"actor": args.actor_zero_stage}
    if needs_reference(args) or args.enable_ema:
        stages["reference" if needs_reference(args) else "EMA"] = (
            3 if args.offload_reference_model else args.actor_zero_stage
        )
    if needs_critic(args.advantage_estimator):
        trained["critic"] = "critic_"
        stages["critic"] = args.critic_zero_stage
    if reward_model_paths:
        stages["reward model"] = 3 if args.offload_reward_model else args.critic_zero_stage
    if getattr(args, "teachers", None) and getattr(args, "teacher_engine", "hf") == "hf":
        stages["teacher"] = 3 if args.offload_teacher_model else args.actor_zero_stage
    if getattr(args, "judge", None) is not None:
        stages["judge"] = 3 if args.offload_judge_model else args.actor_zero_stage
    check_4bit_args(args, trained, stages)
    if args.enable_hybrid_engine and args.merge_lora_for_generation:
        raise ModelFlagError(
            "--load_in_4bit with --enable_hybrid_engine: LoRA merged into 4-bit weights for the rollout does not "
            "come back bit for bit; add --no_merge_lora_for_generation (the rollout runs through the adapters)"
        )


def build_engines(args, tokenizer, total_steps: int, reward_model_paths=()) -> Engines:
    check_qlora_args(args, reward_model_paths)
    quantized = args.load_in_4bit
    ranks = world_size()
    actor_config = train_ds_config(
        args.actor_zero_stage,
        ranks,
        args.per_device_training_batch_size,
        args.gradient_accumulation_steps,
        args.dtype,
        args.offload,
        args.gradient_clipping,
    )
    critic_config = train_ds_config(
        args.critic_zero_stage,
        ranks,
        args.per_device_training_batch_size,
        args.gradient_accumulation_steps,
        args.dtype,
        args.offload,
        args.gradient_clipping,
    )
    actor_spec, critic_spec = spec_from_args(args, "actor_"), spec_from_args(args, "critic_")

    attn = args.attn_implementation
    actor = load_causal_lm(
        args.actor_model_name_or_path,
        tokenizer,
        actor_config,
        args.actor_dropout,
        args.trust_remote_code,
        attn_implementation=attn,
        load_in_4bit=quantized,
    )
    actor = build_trained_engine(actor, actor_config, actor_spec, total_steps)

    def frozen_lm(path: str, offload: bool, own_tokenizer=None):
        """(a causal LM beside the actor, without dropout, and its inference config): the reference, the EMA, a
        teacher, the judge (`own_tokenizer`: its own); at the actor's ZeRO stage, or ZeRO-3 with its parameters in
        CPU memory when `offload`."""
        config = eval_ds_config(args.actor_zero_stage, ranks, args.per_device_training_batch_size, args.dtype, offload)
        model = load_causal_lm(
            path,
            own_tokenizer or tokenizer,
            config,
            0.0,
            args.trust_remote_code,
            attn_implementation=attn,
            load_in_4bit=quantized,
        )
        return model, config

    ref = None
    if needs_reference(args):
        ref = build_frozen_engine(*frozen_lm(args.actor_model_name_or_path, args.offload_reference_model))

    critic = None
    if needs_critic(args.advantage_estimator):
        with four_bit_loading(quantized):  # the backbone's Linear layers; the value head stays as it is
            critic = RewardModel.from_pretrained(
                args.critic_model_name_or_path,
                tokenizer,
                critic_config,
                args.critic_dropout,
                args.trust_remote_code,
                attn,
                require_value_head=not args.critic_fresh_value_head,
            )
        critic = build_trained_engine(critic, critic_config, critic_spec, total_steps)

    reward_config = eval_ds_config(
        args.critic_zero_stage, ranks, args.per_device_training_batch_size, args.dtype, args.offload_reward_model
    )
    rewards = {}
    for path in reward_model_paths:
        with four_bit_loading(quantized):
            reward = RewardModel.from_pretrained(
                path, tokenizer, reward_config, 0.0, args.trust_remote_code, attn, require_value_head=True
            )
        rewards[path] = build_frozen_engine(reward, reward_config)

    ema = None
    if args.enable_ema:
        ema_model, ema_config = frozen_lm(args.actor_model_name_or_path, args.offload_reference_model)
        if actor_spec.lora_dim > 0:  # same structure as the actor, so parameters pair up by name
            ema_model = add_lora(ema_model, actor_spec)
        ema = ActorEMA(initialize_engine(ema_model, ema_config))
        ema.engine.eval()
    teachers = {}
    for teacher in getattr(args, "teachers", []):  # frozen like the reference, scored on the student's tokens
        serve = ROLLOUT_ENGINES[getattr(args, "teacher_engine", "hf")].teacher
        if serve is not None:  # a worker of the engine's own (--teacher_engine)
            teachers[teacher.name] = serve(teacher, args)
        else:
            teachers[teacher.name] = build_frozen_engine(*frozen_lm(teacher.path, args.offload_teacher_model))
    judge = None
    if getattr(args, "judge", None) is not None:  # it reads text: its own tokenizer (step3_ppo/rewards/judge.py)
        judge = build_frozen_engine(*frozen_lm(args.judge.path, args.offload_judge_model, args.judge.tokenizer))
    return Engines(actor=actor, ref=ref, critic=critic, rewards=rewards, ema=ema, teachers=teachers, judge=judge)
