# Sourced by the launch scripts: repository root, venv, offline mode, a free port, demo inputs.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
# shellcheck disable=SC1091
source "$ROOT/.venv/bin/activate"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
# One thread per rank: on a 2-core machine two ranks with more threads each run ~3x slower.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
MASTER_PORT_GIVEN="${MASTER_PORT:-}"
MASTER_PORT="${MASTER_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
DEMO_DATA="${DEMO_DATA:-$ROOT/data/demo}"

# Both print only the model folder on stdout (progress and library warnings go to stderr) and
# fail the script when the folder cannot be made.
default_model() {  # the converted SmolLM2-135M-Instruct directory (converted once)
  python -m utils.default_model --print_path
}
step1_output_or_default_model() {  # step 2's backbone: out/step1 when step 1 ran, else the default
  if [ -f "$ROOT/out/step1/model.safetensors" ]; then echo "$ROOT/out/step1"; else default_model; fi
}
tiny_model() {  # a tiny random model of architecture $1 (gpt2, llama, opt), built once into the cache
  python -m utils.tiny_model --arch "$1" --print_path
}

# Runs a launcher command with its output copied to LOG, and forwards SIGTERM/SIGINT to the whole
# launch: deepspeed's --no_ssh runner does not pass them on, so a stopped node would keep training.
run_logged() {  # run_logged LOG command...
  local log="$1"; shift
  "$@" > >(tee "$log") 2>&1 &
  local launcher_pid=$! rc
  trap 'pkill -TERM -P "$launcher_pid"; kill -TERM "$launcher_pid" 2>/dev/null' TERM INT
  wait "$launcher_pid"; rc=$?
  while kill -0 "$launcher_pid" 2>/dev/null; do wait "$launcher_pid"; rc=$?; done
  return "$rc"
}

ensure_demo_data() {
  [ -f "$DEMO_DATA/pairs/eval.jsonl" ] || python -m data.make_demo_data --out "$DEMO_DATA"
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
    for var in HF_HUB_OFFLINE TRANSFORMERS_OFFLINE OMP_NUM_THREADS GLOO_SOCKET_IFNAME TOKENIZERS_PARALLELISM; do
      [ -n "${!var:-}" ] && echo "$var=${!var}" >> "$env_file"
    done
    echo "env DS_ENV_FILE=$env_file deepspeed --hostfile $hostfile --master_port $MASTER_PORT${MASTER_ADDR:+ --master_addr $MASTER_ADDR}"
  fi
}
