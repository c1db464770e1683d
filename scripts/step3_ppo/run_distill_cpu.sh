#!/usr/bin/env bash
# Step 3 as on-policy distillation alone on CPU, the arithmetic task (scripts/demo.sh --task distill): the student
# samples answers, a frozen teacher scores its tokens, and minus their sampled reverse KL to the teacher is the
# advantage (no reward trained on, no critic, no reference model); otherwise run_grpo_cpu.sh's settings (2 ranks
# (gloo), ZeRO-3 + hybrid generation, fp32, 4 answers per prompt); held-out greedy accuracy (math_exact) on 128
# problems before training, every 2 iterations and at the end.
# usage: bash scripts/step3_ppo/run_distill_cpu.sh [OUTPUT_DIR (out/step3)] [extra step3_ppo/main.py arguments]
# env: TEACHER (default out/grpo/actor: the arithmetic GRPO policy of scripts/demo.sh --task arithmetic; it must
#      share the student's tokenizer), ACTOR (the student; default the embedded SmolLM2-135M-Instruct), DATA (prompt
#      rows with an 'answer' field; default data/arithmetic), NUM_RANKS (2), MAX_STEPS (10), MASTER_PORT (a free
#      one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
grpo_inputs || exit
launch_step cpu step3_ppo.main arithmetic \
  --config configs/step3_ppo/distill_arithmetic_cpu.yaml --teacher_model_name_or_path "${TEACHER:-$ROOT/out/grpo/actor}" \
  ${MAX_STEPS:+--max_steps "$MAX_STEPS"} \
  -- "$@"
