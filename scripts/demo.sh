#!/usr/bin/env bash
# Sets up, then runs the whole pipeline on CPU: step 1 SFT -> step 2 reward model -> step 3 RL (RLOO) on
# the embedded SmolLM2-135M-Instruct and the Rotten-Tomatoes demo task, then evaluates the SFT and
# RLHF policies side by side (reward model, two independent judges with 95% intervals, KL to SFT,
# lengths) and
# draws OUTPUT_ROOT/step3/curves.png.
# usage: bash scripts/demo.sh [--step 1 2 3] [--with_dpo [LOSS]] [--output_root DIR] [--quick] [--format chat|raw]
#                             [--task arithmetic|tools|distill|reasoning_gym] [--eval_split test|dev]
#   --with_dpo [LOSS]: also DPO from the step-1 model on the step-2 pairs (scripts/step2_dpo/run_cpu.sh, after
#             step 2), and its row in the evaluation next to SFT and RLHF; LOSS: the DPO step's --loss_type
#             (sigmoid, the default: a "DPO" row; ipo, simpo, orpo, kto: a row named after it)
#   --quick: tiny random models, a few steps, a small copy of the demo data (a smoke test of the whole
#             chain, about 80 s on 2 cores)
#   --format: chat (default): the demo rows are conversations rendered with SmolLM2's chat template;
#             raw: DeepSpeed-Chat's "Human: ...\n\nAssistant:" strings, concatenated as they are
#   --eval_split: test (default): the final evaluation reads the test split's 256 prompts (DEMO_DATA/test), which
#             nothing else reads; dev: 256 prompts of the dev split (DEMO_DATA/pairs/eval.jsonl, also step 2's
#             held-out pairs), the one to compare settings on (the demo's were chosen there)
#   --task arithmetic: the verifiable demo instead: GRPO of SmolLM2-135M-Instruct on arithmetic problems
#             scored by the math_exact reward (no step 1, no step 2, no critic); held-out greedy accuracy
#             before -> after, curves in OUTPUT_ROOT/grpo/curves.png
#   --task tools: the tool-use demo: SFT of SmolLM2-135M-Instruct on calculator traces, then multi-turn GRPO
#             with --tools calculator on arithmetic word problems scored by math_exact (no step 2, no critic);
#             held-out greedy accuracy without tools, after SFT and after RL, tool-call and tool-error rates;
#             outputs and curves under OUTPUT_ROOT/tools
#   --task distill: on-policy distillation of SmolLM2-135M-Instruct from the arithmetic GRPO policy (--task
#             arithmetic's OUTPUT_ROOT/grpo, reused when that run is complete, made first otherwise) with no reward;
#             held-out greedy accuracy before, every 2 iterations and after; a table of teacher, student before,
#             after distillation and GRPO given the same training time, in OUTPUT_ROOT/distill (comparison.txt,
#             accuracy_vs_time.png, curves.png)
#   --task reasoning_gym: GRPO of SmolLM2-135M-Instruct on reasoning-gym's chain_sum task (rows generated offline,
#             configs/step3_ppo/grpo_reasoning_gym_cpu.yaml: the arithmetic recipe, trained on math_exact, the
#             library's own score logged as reasoning_gym); held-out greedy accuracy before -> after, curves in
#             OUTPUT_ROOT/reasoning_gym/curves.png
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEPS=(1 2 3)
OUTPUT_ROOT="$ROOT/out"
QUICK="${QUICK:-0}"
TASK=reviews
WITH_DPO=0
DPO_LOSS=sigmoid
EVAL_SPLIT=test
while [ $# -gt 0 ]; do
  case "$1" in
    --step) shift; STEPS=(); while [ $# -gt 0 ] && [[ "$1" =~ ^[123]$ ]]; do STEPS+=("$1"); shift; done ;;
    --with_dpo) WITH_DPO=1; shift
      if [ $# -gt 0 ] && [[ "$1" != --* ]]; then
        case "$1" in sigmoid|ipo|simpo|orpo|kto) DPO_LOSS="$1"; shift ;;
          *) echo "--with_dpo: the loss must be sigmoid, ipo, simpo, orpo or kto, got $1" >&2; exit 2 ;; esac
      fi ;;
    --output_root) OUTPUT_ROOT="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --format) export DEMO_FORMAT="$2"; shift 2 ;;
    --task) TASK="$2"; shift 2 ;;
    --eval_split) EVAL_SPLIT="$2"; shift 2
      case "$EVAL_SPLIT" in test|dev) ;; *) echo "--eval_split must be test or dev, got $EVAL_SPLIT" >&2; exit 2 ;; esac ;;
    *) echo "unknown argument: $1 (use --step 1 2 3, --with_dpo [LOSS], --output_root DIR, --quick, --format chat|raw," \
            "--task arithmetic|tools|distill|reasoning_gym, --eval_split test|dev)" >&2
       exit 2 ;;
  esac
done
USER_OMP_NUM_THREADS="${OMP_NUM_THREADS:-}"
# shellcheck source=common.sh
source "$ROOT/scripts/common.sh"  # set-up, venv, offline mode, default_model/tiny_model
case "$DEMO_FORMAT" in chat|raw) ;; *) echo "--format must be chat or raw, got $DEMO_FORMAT" >&2; exit 2 ;; esac
if [ "$TASK" = distill ]; then
  start=$(date +%s)
  G=(--overwrite_output_dir) D=(--overwrite_output_dir)
  if [ "$QUICK" = 1 ]; then  # tiny random models with ChatML: a smoke test of the chain
    STUDENT="$(tiny_model llama)"
    G+=(--chat_template utils/chat_templates/chatml.jinja --max_steps 2 --max_prompt_seq_len 96 --eval_num_prompts 8)
    D+=(--chat_template utils/chat_templates/chatml.jinja --max_steps 2 --max_prompt_seq_len 96 --eval_num_prompts 8
        --eval_interval 1)
  else
    STUDENT="$(default_model)"
  fi
  # the teacher: --task arithmetic's GRPO policy, trained from this student; its run is complete when its actor was
  # exported (at the end of the run) from this very student
  if [ -f "$OUTPUT_ROOT/grpo/actor/model.safetensors" ] \
      && grep -qxF "actor_model_name_or_path: $STUDENT" "$OUTPUT_ROOT/grpo/config.yaml" 2>/dev/null; then
    echo "[demo] teacher: the GRPO policy of $OUTPUT_ROOT/grpo (reused)"
  else
    echo "[demo] teacher: GRPO of $STUDENT on the arithmetic task -> $OUTPUT_ROOT/grpo"
    t0=$(date +%s)
    ACTOR="$STUDENT" bash scripts/step3_ppo/run_grpo_cpu.sh "$OUTPUT_ROOT/grpo" "${G[@]}"
    python -m step3_ppo.plot "$OUTPUT_ROOT/grpo" >/dev/null
    echo "[demo] the teacher's GRPO run took $(( $(date +%s) - t0 )) s"
  fi
  t0=$(date +%s)
  echo "[demo] on-policy distillation of $STUDENT from $OUTPUT_ROOT/grpo/actor (no reward) -> $OUTPUT_ROOT/distill"
  ACTOR="$STUDENT" TEACHER="$OUTPUT_ROOT/grpo/actor" bash scripts/step3_ppo/run_distill_cpu.sh "$OUTPUT_ROOT/distill" \
    "${D[@]}"
  echo "[demo] distillation took $(( $(date +%s) - t0 )) s"
  python -m step3_ppo.plot "$OUTPUT_ROOT/distill" >/dev/null
  echo "[demo] held-out greedy accuracy (math_exact); training time = generation + experience + training seconds:"
  python scripts/distill_compare.py --distill "$OUTPUT_ROOT/distill" --grpo "$OUTPUT_ROOT/grpo"
  echo "[demo] finished in $(( $(date +%s) - start )) s; outputs under $OUTPUT_ROOT/distill (curves.png," \
    "accuracy_vs_time.png, comparison.txt)"
  exit 0
fi
if [ "$TASK" = arithmetic ]; then
  start=$(date +%s)
  G=(--overwrite_output_dir)
  if [ "$QUICK" = 1 ]; then  # a tiny random model with ChatML: a smoke test of the chain
    export ACTOR="$(tiny_model llama)"
    G+=(--chat_template utils/chat_templates/chatml.jinja --max_steps 2 --max_prompt_seq_len 96 --eval_num_prompts 8)
  fi
  echo "[demo] GRPO on the arithmetic task -> $OUTPUT_ROOT/grpo"
  bash scripts/step3_ppo/run_grpo_cpu.sh "$OUTPUT_ROOT/grpo" "${G[@]}"
  echo "[demo] held-out greedy evaluation, before -> after (accuracy = math_exact; format = answers in the asked form):"
  python -m step3_ppo.plot "$OUTPUT_ROOT/grpo"
  echo "[demo] finished in $(( $(date +%s) - start )) s; outputs under $OUTPUT_ROOT/grpo"
  exit 0
fi
if [ "$TASK" = reasoning_gym ]; then
  start=$(date +%s)
  G=(--config configs/step3_ppo/grpo_reasoning_gym_cpu.yaml --overwrite_output_dir)
  export DATA="reasoning_gym:chain_sum:size=2000,eval_size=200,seed=1,system=direct,min_terms=2,max_terms=2,max_digits=2"
  if [ "$QUICK" = 1 ]; then  # a tiny random model with ChatML and a small copy of the rows: a smoke test
    export ACTOR="$(tiny_model llama)"
    DATA="${DATA/size=2000,eval_size=200/size=64,eval_size=16}"
    G+=(--chat_template utils/chat_templates/chatml.jinja --max_steps 2 --max_prompt_seq_len 96 --eval_num_prompts 8)
  fi
  echo "[demo] GRPO on reasoning-gym's chain_sum -> $OUTPUT_ROOT/reasoning_gym"
  bash scripts/step3_ppo/run_grpo_cpu.sh "$OUTPUT_ROOT/reasoning_gym" "${G[@]}"
  echo "[demo] held-out greedy evaluation, before -> after (accuracy = math_exact; reasoning_gym = the library's score):"
  python -m step3_ppo.plot "$OUTPUT_ROOT/reasoning_gym"
  echo "[demo] finished in $(( $(date +%s) - start )) s; outputs under $OUTPUT_ROOT/reasoning_gym"
  exit 0
fi

if [ "$TASK" = tools ]; then
  start=$(date +%s)
  T="$OUTPUT_ROOT/tools" TOOLS_DATA="$ROOT/data/tools"
  BASE_EVAL=(--num_prompts 128 --max_new_tokens 48 --batch_size 32)
  # step 1's settings on the calculator traces: configs/demo/tools_step1_sft.yaml, over run_cpu.sh's preset
  S1=(--config configs/demo/tools_step1_sft.yaml --max_steps 10 --overwrite_output_dir) S3=(--overwrite_output_dir)
  if [ "$QUICK" = 1 ]; then  # a tiny random model with ChatML and a small copy of the data: a smoke test
    BASE="$(python -m utils.models.tiny --arch llama --chat --out "$OUTPUT_ROOT/tiny_chat_llama" --print_path)"
    TOOLS_DATA="$OUTPUT_ROOT/tools_data"
    python -m data.make_tool_data --out "$TOOLS_DATA" --sft 64 --train 64 --eval 16 >/dev/null
    BASE_EVAL=(--num_prompts 8 --max_new_tokens 8 --batch_size 8)
    S1+=(--max_steps 2)
    S3+=(--max_steps 2 --eval_num_prompts 8 --max_answer_seq_len 8 --max_trajectory_len 40 --max_prompt_seq_len 256)
  else
    BASE="$(default_model)"
    [ -f "$TOOLS_DATA/rl/eval.jsonl" ] || python -m data.make_tool_data --out "$TOOLS_DATA" >/dev/null
  fi
  mkdir -p "$T"
  t0=$(date +%s)
  echo "[demo] $BASE without tools on ${BASE_EVAL[1]} held-out word problems (greedy, math_exact)"
  OMP_NUM_THREADS="${USER_OMP_NUM_THREADS:-2}" python -m step3_ppo.eval --sft_model "$BASE" --reward_funcs math_exact \
    --prompts "$TOOLS_DATA/rl/eval.jsonl" --out "$T/without_tools.json" "${BASE_EVAL[@]}" > "$T/without_tools.txt"
  echo "[demo] evaluation without tools took $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
  echo "[demo] step 1: SFT of $BASE on calculator traces -> $T/step1"
  MODEL="$BASE" DATA="$TOOLS_DATA/sft" bash scripts/step1_sft/run_cpu.sh "$T/step1" "${S1[@]}"
  echo "[demo] step 1 took $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
  echo "[demo] step 3: GRPO with --tools calculator, actor $T/step1 -> $T/grpo"
  ACTOR="$T/step1" DATA="$TOOLS_DATA/rl" bash scripts/step3_ppo/run_tools_cpu.sh "$T/grpo" "${S3[@]}"
  echo "[demo] step 3 took $(( $(date +%s) - t0 )) s"
  python -m step3_ppo.plot "$T/grpo" >/dev/null
  python -m step3_ppo.agents.eval --without_tools "$T/without_tools.json" --run "$T/grpo" | tee "$T/eval.txt"
  echo "[demo] finished in $(( $(date +%s) - start )) s; outputs under $T (curves: $T/grpo/curves.png)"
  exit 0
fi
[ "$TASK" = reviews ] || { echo "--task must be arithmetic, tools, distill or reasoning_gym (or left out), got $TASK" >&2; exit 2; }
if [ "$WITH_DPO" = 1 ]; then  # DPO runs after steps 1-2 (it needs step 1's model), before step 3
  ORDERED=(); for step in "${STEPS[@]}"; do ORDERED+=("$step"); [ "$step" = 2 ] && ORDERED+=(dpo); done
  [[ " ${ORDERED[*]} " == *" dpo "* ]] || ORDERED=(dpo "${ORDERED[@]}")
  STEPS=("${ORDERED[@]}")
fi
DATA_SIZES=()
if [ "$QUICK" = 1 ]; then  # a smoke test reads a few steps' rows: a small copy of the demo data, not 6600 rows
  export DEMO_DATA="$OUTPUT_ROOT/data"
  DATA_SIZES=(--sft_train 256 --sft_eval 64 --pairs_train 256 --pairs_eval 64 --test 16)
fi
python -m data.make_demo_data --out "$DEMO_DATA" --format "$DEMO_FORMAT" "${DATA_SIZES[@]}" >/dev/null
STEP1="$OUTPUT_ROOT/step1" STEP2="$OUTPUT_ROOT/step2" STEP3="$OUTPUT_ROOT/step3" DPO="$OUTPUT_ROOT/step2_dpo"
# Step 3 of the demo: RLOO on the reward model with DAPO's overlong penalty, over run_cpu.sh's PPO preset
# (configs/demo/step3_rloo.yaml says what and why); 10 iterations (--max_steps 10 below)
RL=(--config configs/demo/step3_rloo.yaml)
if [ "$QUICK" = 1 ]; then
  BASE="$(tiny_model llama)"
  # held-out pairs: two batches of 8 per rank (32 of the 64), enough to show the figures
  S1=(--max_steps 3) S2=(--max_steps 3 --eval_iters 2 --per_device_eval_batch_size 8)
  SD=(--max_steps 3 --eval_iters 2 --per_device_eval_batch_size 8)
  S3=("${RL[@]}" --max_steps 2 --max_answer_seq_len 8 --overlong_buffer_len 2)
  EVAL=(--num_prompts 8 --max_new_tokens 8)
  # the tiny model has no chat template: give it ChatML (saved with steps 1-2's tokenizers, so step 3 finds it);
  # its markers are plain text to this tokenizer, so the template's frame alone is ~43 prompt tokens
  [ "$DEMO_FORMAT" = chat ] && S1+=(--chat_template utils/chat_templates/chatml.jinja) \
    S2+=(--chat_template utils/chat_templates/chatml.jinja) S3+=(--max_prompt_seq_len 96)
else
  BASE="$(default_model)"
  # the demo's 20-minute budget, settings chosen on the dev split (--eval_split dev; 4
  # configurations tried, README): 20 steps of step 1 (its loss levels off by step ~20 of 40), 40 of step 2 (20 gave
  # a reward model whose scores RL exploited: configs/demo/step3_rloo.yaml), 10 RL iterations (12 measured
  # 20 min 25 s from a fresh clone); step 1's perplexity on 64 of the 300 held-out rows (2 batches of 16 per rank)
  # and step 2's accuracy on 64 of the 300 held-out pairs (1 batch of 32 per rank), each evaluation ~80% cheaper
  # than on all 300; the final evaluation in batches of 64 (~10% faster than 32)
  S1=(--max_steps 20 --num_warmup_steps 3 --eval_iters 2) S2=(--max_steps 40 --eval_iters 1) SD=()
  S3=("${RL[@]}" --max_steps 10) EVAL=(--num_prompts 256 --batch_size 64)
fi
# a demo run replaces the outputs of the previous one (the training steps refuse a used directory otherwise)
S1+=(--overwrite_output_dir) S2+=(--overwrite_output_dir) SD+=(--overwrite_output_dir) S3+=(--overwrite_output_dir)
start=$(date +%s)
for step in "${STEPS[@]}"; do
  t0=$(date +%s)
  case "$step" in
    1) echo "[demo] step 1: SFT of $BASE -> $STEP1"
       MODEL="$BASE" bash scripts/step1_sft/run_cpu.sh "$STEP1" "${S1[@]}" ;;
    2) echo "[demo] step 2: reward model from $BASE -> $STEP2"
       MODEL="$BASE" bash scripts/step2_reward/run_cpu.sh "$STEP2" "${S2[@]}" ;;
    dpo) echo "[demo] step 2 alternative: DPO ($DPO_LOSS) of $STEP1 -> $DPO"
       LOSS_TYPE="$DPO_LOSS" MODEL="$STEP1" bash scripts/step2_dpo/run_cpu.sh "$DPO" "${SD[@]}" ;;
    3) echo "[demo] step 3: PPO, actor $STEP1, critic $STEP2 -> $STEP3"
       ACTOR="$STEP1" CRITIC="$STEP2" bash scripts/step3_ppo/run_cpu.sh "$STEP3" "${S3[@]}"
       python -m step3_ppo.plot "$STEP3" ;;
  esac
  echo "[demo] step $step took $(( $(date +%s) - t0 )) s"
done
POLICIES=()
DPO_ROW=dpo; [ "$DPO_LOSS" = sigmoid ] || DPO_ROW="$DPO_LOSS"
[ "$WITH_DPO" = 1 ] && [ -f "$DPO/model.safetensors" ] && POLICIES+=(--policy "$DPO_ROW=$DPO")
if [ -f "$STEP3/actor/model.safetensors" ]; then
  t0=$(date +%s)
  # the test split: prompts no step trained on and no choice of the demo's settings looked at (those used the
  # dev split, pairs/eval.jsonl: --eval_split dev)
  PROMPTS="$DEMO_DATA/test/prompts.jsonl"; [ "$EVAL_SPLIT" = dev ] && PROMPTS="$DEMO_DATA/pairs/eval.jsonl"
  echo "[demo] evaluating SFT vs RLHF${POLICIES:+ and DPO} on the $EVAL_SPLIT split's prompts"
  OMP_NUM_THREADS="${USER_OMP_NUM_THREADS:-2}" python -m step3_ppo.eval --sft_model "$STEP1" --rlhf_model "$STEP3/actor" \
    "${POLICIES[@]}" --reward_model "$STEP2" --prompts "$PROMPTS" --out "$OUTPUT_ROOT/eval.json" \
    "${EVAL[@]}" | tee "$OUTPUT_ROOT/eval.txt"
  echo "[demo] evaluation took $(( $(date +%s) - t0 )) s"
fi
echo "[demo] finished in $(( $(date +%s) - start )) s; outputs under $OUTPUT_ROOT (curves: $STEP3/curves.png)"
