# Sourced by the launch scripts: repository root, venv, offline mode, a free port, demo inputs.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# DeepSpeed's JIT-built ops (its CPU communication op) go to this checkout's own folder, not the shared
# ~/.cache/torch_extensions, where two checkouts wait on each other's build lock (utils/runtime/extensions.py).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
# RLHF_USE_CURRENT_ENV=1: run with the python and packages already on PATH (a cluster's module, a
# machine without network such as bench/gpu.sh's); otherwise set up and enter the repository's venv.
if [ -z "${RLHF_USE_CURRENT_ENV:-}" ]; then
  bash "$ROOT/scripts/setup.sh"
  # shellcheck disable=SC1091
  source "$ROOT/.venv/bin/activate"
fi
# The project's modules: installed in .venv (setup.sh, editable); with RLHF_USE_CURRENT_ENV, found from here
# (`python -m` and the launcher's ranks, on every node, put the working directory first on sys.path): no PYTHONPATH.
cd "$ROOT"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
# One thread per rank: on a 2-core machine two ranks with more threads each run ~3x slower.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
MASTER_PORT_GIVEN="${MASTER_PORT:-}"
MASTER_PORT="${MASTER_PORT:-$(python -m utils.runtime.ports)}"
# DEMO_FORMAT: chat (messages rows, the model's chat template; default) or raw (Human/Assistant strings)
DEMO_FORMAT="${DEMO_FORMAT:-chat}"
if [ "$DEMO_FORMAT" = chat ]; then DEMO_DATA="${DEMO_DATA:-$ROOT/data/demo}"; else DEMO_DATA="${DEMO_DATA:-$ROOT/data/demo_$DEMO_FORMAT}"; fi

# Both print only the model folder on stdout (progress and library warnings go to stderr) and
# fail the script when the folder cannot be made.
default_model() {  # the converted SmolLM2-135M-Instruct directory (converted once)
  python -m utils.models.default --print_path
}
step1_output_or_default_model() {  # step 2's backbone: out/step1 when step 1 ran, else the default
  if [ -f "$ROOT/out/step1/model.safetensors" ]; then echo "$ROOT/out/step1"; else default_model; fi
}
tiny_model() {  # a tiny random model of architecture $1 (gpt2, llama, opt), built once into the cache
  python -m utils.models.tiny --arch "$1" --print_path
}

# Runs a launcher command with its output copied to LOG, and forwards SIGTERM/SIGINT to the whole
# launch: deepspeed's --no_ssh runner does not pass them on, so a stopped node would keep training.
# The copy (tee) is this shell's child, outside the launch, so it keeps logging the launch's last
# words after a signal and is waited for (up to 10 s, in case an orphan of the launch keeps the
# pipe open): LOG is complete when this returns. Returns the launch's exit status.
run_logged() {  # run_logged LOG command...
  local log="$1"; shift
  local log_fd tee_pid launcher_pid rc i
  exec {log_fd}> >(exec tee -i "$log")
  tee_pid=$!
  "$@" >&"$log_fd" 2>&1 {log_fd}>&- &
  launcher_pid=$!
  exec {log_fd}>&-
  trap 'pkill -TERM -P "$launcher_pid"; kill -TERM "$launcher_pid" 2>/dev/null' TERM INT
  wait "$launcher_pid"; rc=$?
  while kill -0 "$launcher_pid" 2>/dev/null; do wait "$launcher_pid"; rc=$?; done
  for i in $(seq 100); do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.1; done
  return "$rc"
}

ensure_demo_data() {
  [ -f "$DEMO_DATA/test/prompts.jsonl" ] || python -m data.make_demo_data --out "$DEMO_DATA" --format "$DEMO_FORMAT"
}

# default_data DIR MODULE [OUT]: DATA as given, else DIR, whose rows `python -m MODULE --out OUT` (OUT: DIR)
# generates offline the first time (DIR/eval.jsonl missing)
default_data() {
  if [ -z "${DATA:-}" ]; then
    DATA="$1"
    [ -f "$DATA/eval.jsonl" ] || python -m "$2" --out "${3:-$1}" >/dev/null || return
  fi
}
# The GRPO scripts' inputs: the base model as actor (no step 1 needed), no critic, no reward model (function
# rewards), the arithmetic task generated offline into data/arithmetic unless DATA names other prompt rows.
grpo_inputs() {
  ACTOR="${ACTOR:-$(default_model)}" || return
  CRITIC="${CRITIC:-none}"
  default_data "$ROOT/data/arithmetic" data.make_arithmetic_data
}
tools_inputs() {  # the tool-use demo's step 3 (run_tools_cpu.sh): a step-1 actor, no critic, data/tools/rl
  ACTOR="${ACTOR:-${STEP1_DIR:-$ROOT/out/step1}}"
  CRITIC=none
  default_data "$ROOT/data/tools/rl" data.make_tool_data "$ROOT/data/tools"
}
# Multi-node: MULTI_NODE_MODE=ssh (default; the launcher reaches every host of the hostfile over
# pdsh/ssh) or no_ssh (start THIS node only: NODE_RANK, MASTER_ADDR, MASTER_PORT must be set, e.g.
# by a scheduler). The output directory must be on a filesystem every node sees.
multi_node_launcher() {  # prints the launcher prefix for the given hostfile
  local hostfile="$1"
  [ -f "$hostfile" ] || { echo "error: hostfile $hostfile not found (lines like 'node1 slots=8')" >&2; exit 2; }
  if [ "${MULTI_NODE_MODE:-ssh}" = "no_ssh" ]; then
    : "${NODE_RANK:?set NODE_RANK for MULTI_NODE_MODE=no_ssh}" "${MASTER_ADDR:?set MASTER_ADDR for MULTI_NODE_MODE=no_ssh}" \
      "${MASTER_PORT_GIVEN:?set MASTER_PORT (the same on every node) for MULTI_NODE_MODE=no_ssh}"
    echo "deepspeed --hostfile $hostfile --no_ssh --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT"
  else
    # pdsh forwards only NCCL*/PYTHON* variables (and a .deepspeed_env file) to the other nodes
    local env_file
    env_file="$(mktemp)"
    for var in HF_HUB_OFFLINE TRANSFORMERS_OFFLINE OMP_NUM_THREADS GLOO_SOCKET_IFNAME TOKENIZERS_PARALLELISM \
               TORCH_EXTENSIONS_DIR; do
      [ -n "${!var:-}" ] && echo "$var=${!var}" >> "$env_file"
    done
    # DS_ENV_FILE replaces the launcher's own ~/.deepspeed_env and ./.deepspeed_env: their lines go in too, after
    # ours, so that a variable the user put there still reaches every node (and wins)
    local user_env
    for user_env in "$HOME/.deepspeed_env" "$ROOT/.deepspeed_env"; do
      [ -f "$user_env" ] && grep '=' "$user_env" >> "$env_file"
    done
    echo "env DS_ENV_FILE=$env_file deepspeed --hostfile $hostfile --master_port $MASTER_PORT${MASTER_ADDR:+ --master_addr $MASTER_ADDR}"
  fi
}

# The run scripts scripts/step{1_sft,2_reward,2_dpo,3_ppo}/run_{cpu,single_gpu,single_node,multi_node}.sh
# are each one call of launch_step, which does their common part:
#   launch_step KIND MODULE DEMO_SOURCE [STEP FLAGS...] -- [OUTPUT_DIR] [EXTRA ARGS...]
# KIND         the launcher: cpu          deepspeed --num_gpus ${NUM_RANKS:-2} (gloo ranks here)
#                            single_gpu   deepspeed --num_gpus 1
#                            single_node  deepspeed (every local GPU)
#                            multi_node   multi_node_launcher ${HOSTFILE:-./hostfile} (see above)
# MODULE       step1_sft.main, step2_reward.main, step2_dpo.main or step3_ppo.main
# DEMO_SOURCE  the data/demo source used when DATA is unset: sft or pairs (made on first use)
# STEP FLAGS   the step's own flags: --config configs/STEP/PRESET.yaml (the run's settings, one preset per script;
#              docs/guides/configuration.md) and those the script's env variables set (MAX_STEPS, DTYPE);
#              everything after -- is the run script's "$@" (command-line flags win over the preset's).
# Launched: LAUNCHER --module MODULE MODEL_ARGS --data_path $DATA STEP_FLAGS --output_dir OUTPUT_DIR
# EXTRA_ARGS (last, so they override), where MODEL_ARGS is --model_name_or_path $MODEL (steps 1, 2)
# or --actor_model_name_or_path $ACTOR --critic_model_name_or_path $CRITIC (step 3) and $DATA is
# word-split (several sources). Defaults: OUTPUT_DIR out/stepN (DPO: out/step2_dpo); MODEL default_model
# (step 1), step1_output_or_default_model (step 2, DPO); ACTOR ${STEP1_DIR:-out/step1}; CRITIC ${STEP2_DIR:-out/step2}.
# The output is copied to OUTPUT_DIR/train.log (multi_node: train.log.node${NODE_RANK:-0}) by
# run_logged. Returns the launch's exit status (or a failing preamble step's, before any launch).
launch_step() {
  local kind="$1" module="$2" demo_source="$3" step launch rc
  shift 3
  local -a flags=() launcher=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
  local name
  case "$module" in
    step1_*) step=1 name=step1 ;; step2_dpo.*) step=2 name=step2_dpo ;; step2_*) step=2 name=step2 ;;
    step3_*) step=3 name=step3 ;;
    *) echo "launch_step: unknown step module $module" >&2; return 2 ;;
  esac
  OUTPUT="${1:-$ROOT/out/$name}"; shift || true
  local -a model_args
  case "$step" in
    1) MODEL="${MODEL:-$(default_model)}" || return; model_args=(--model_name_or_path "$MODEL") ;;
    2) MODEL="${MODEL:-$(step1_output_or_default_model)}" || return; model_args=(--model_name_or_path "$MODEL") ;;
    3) ACTOR="${ACTOR:-${STEP1_DIR:-$ROOT/out/step1}}"; CRITIC="${CRITIC:-${STEP2_DIR:-$ROOT/out/step2}}"
       model_args=(--actor_model_name_or_path "$ACTOR")
       # CRITIC=none: a critic-free run scored by reward functions (the GRPO scripts)
       [ "$CRITIC" != none ] && model_args+=(--critic_model_name_or_path "$CRITIC") ;;
  esac
  if [ -z "${DATA:-}" ]; then ensure_demo_data || return; DATA="$DEMO_DATA/$demo_source"; fi
  mkdir -p "$OUTPUT" || return
  local log="$OUTPUT/train.log"
  case "$kind" in
    cpu) launcher=(deepspeed --num_gpus "${NUM_RANKS:-2}" --master_port "$MASTER_PORT") ;;
    single_gpu) launcher=(deepspeed --num_gpus 1 --master_port "$MASTER_PORT") ;;
    single_node) launcher=(deepspeed --master_port "$MASTER_PORT") ;;
    multi_node) launch="$(multi_node_launcher "${HOSTFILE:-./hostfile}")" || return
                read -ra launcher <<< "$launch"; log="$OUTPUT/train.log.node${NODE_RANK:-0}" ;;
    *) echo "launch_step: unknown kind $kind (cpu, single_gpu, single_node, multi_node)" >&2; return 2 ;;
  esac
  if [ "$step" = 3 ]; then
    echo "[step3] actor $ACTOR, critic $CRITIC, data $DATA, output $OUTPUT"
  else
    echo "[$name] model $MODEL, data $DATA, output $OUTPUT"
  fi
  # shellcheck disable=SC2086  # DATA holds one or several sources
  run_logged "$log" "${launcher[@]}" --module "$module" "${model_args[@]}" --data_path $DATA "${flags[@]}" \
    --output_dir "$OUTPUT" "$@"
  rc=$?
  # DeepSpeed's CPU shared-memory comm op never unlinks its buffers (69 MB per rank per run).
  [ "$kind" = cpu ] && rm -f /dev/shm/deepspeed_allreduce_buffer_*_"${MASTER_PORT}"_*
  return "$rc"
}
