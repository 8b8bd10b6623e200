# shellcheck shell=bash
# Sourced by the scripts in slurm/: builds the torchrun command each node runs and either starts it with
# srun (one task per node) or, with HETERO_DRY_RUN=1, prints it once per node and runs nothing.
#
# Read from the environment (SLURM sets the first three; a dry run sets them by hand):
#   SLURM_JOB_NODELIST   hostlist of the allocation, e.g. gpu[01-04]; its first host is MASTER_ADDR
#   SLURM_NNODES         node count (must match the hostlist; defaults to its length)
#   SLURM_JOB_ID         the rendezvous id
#   GPUS_PER_NODE        torchrun --nproc_per_node (default SLURM_GPUS_ON_NODE, else 8)
#   MASTER_PORT          rendezvous port on the first host (default 29500)
#   HETERO_MAX_RESTARTS  torchrun --max-restarts (default 0)
#   HETERO_RDZV_JOIN_TIMEOUT, HETERO_RDZV_READ_TIMEOUT   seconds (default 900 and 300)
#   HETERO_DRY_RUN       1: print "[node I HOST] COMMAND" per node instead of running srun
#   HETERO_PYTHON        interpreter for the hostlist fallback when scontrol is absent (default python3)

hetero_die() {
  echo "${0##*/}: $*" >&2
  exit 2
}

# True when HETERO_DRY_RUN is set to anything but "" or 0.
hetero_dry_run() {
  [[ -n ${HETERO_DRY_RUN:-} && ${HETERO_DRY_RUN} != 0 ]]
}

# Print the arguments as one shell-safe line (quoted like Python's shlex.quote, so it can be pasted).
hetero_quote() {
  local arg quoted=() sq="'\\''"
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
      quoted+=("$arg")
    else
      quoted+=("'${arg//\'/$sq}'")
    fi
  done
  printf '%s\n' "${quoted[*]}"
}

hetero_require_int() {  # NAME VALUE
  [[ $2 =~ ^[0-9]+$ ]] || hetero_die "$1 must be a whole number, got '$2'"
}

# One host per line for a SLURM hostlist: scontrol when present, else hetero/launch_hosts.py.
hetero_hosts() {
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$1"
  else
    local python=${HETERO_PYTHON:-}
    if [[ -z $python ]]; then
      python=$(command -v python3 || command -v python) || hetero_die "neither scontrol nor python3 found to expand '$1'"
    fi
    "$python" -m hetero.launch_hosts "$1"
  fi
}

# hetero_launch TARGET [ARGS...]: torchrun TARGET ARGS on every node of the allocation (run from the
# repository root). Sets and exports MASTER_ADDR, MASTER_PORT and the NCCL-friendly defaults below.
hetero_launch() {
  local target=$1
  shift
  local dry=""
  if hetero_dry_run; then
    dry=" (for HETERO_DRY_RUN=1 set SLURM_JOB_NODELIST, SLURM_NNODES and SLURM_JOB_ID yourself)"
  fi
  [[ -n ${SLURM_JOB_NODELIST:-} ]] || hetero_die "SLURM_JOB_NODELIST is not set: submit with sbatch$dry"
  [[ -n ${SLURM_JOB_ID:-} ]] || hetero_die "SLURM_JOB_ID is not set: submit with sbatch$dry"

  local hosts_text
  hosts_text=$(hetero_hosts "$SLURM_JOB_NODELIST") || hetero_die "cannot expand SLURM_JOB_NODELIST='$SLURM_JOB_NODELIST'"
  local -a hosts
  mapfile -t hosts <<<"$hosts_text"
  local nnodes=${SLURM_NNODES:-${#hosts[@]}}
  hetero_require_int SLURM_NNODES "$nnodes"
  if ((nnodes != ${#hosts[@]})); then
    hetero_die "SLURM_NNODES=$nnodes but SLURM_JOB_NODELIST='$SLURM_JOB_NODELIST' names ${#hosts[@]} hosts"
  fi

  local gpus_per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  local max_restarts=${HETERO_MAX_RESTARTS:-0}
  local join_timeout=${HETERO_RDZV_JOIN_TIMEOUT:-900}
  local read_timeout=${HETERO_RDZV_READ_TIMEOUT:-300}
  export MASTER_ADDR=${hosts[0]}
  export MASTER_PORT=${MASTER_PORT:-29500}
  hetero_require_int GPUS_PER_NODE "$gpus_per_node"
  hetero_require_int MASTER_PORT "$MASTER_PORT"
  hetero_require_int HETERO_MAX_RESTARTS "$max_restarts"
  hetero_require_int HETERO_RDZV_JOIN_TIMEOUT "$join_timeout"
  hetero_require_int HETERO_RDZV_READ_TIMEOUT "$read_timeout"

  # Defaults only where the site or the user has not chosen: one OpenMP thread per rank (torchrun's
  # own default, without its warning), unbuffered logs, NCCL errors raised instead of hangs.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  export PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-1}
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

  # c10d rendezvous: node ranks come from the rendezvous, so every node runs the same command.
  local -a cmd=(
    torchrun
    --nnodes "$nnodes"
    --nproc_per_node "$gpus_per_node"
    --rdzv_backend c10d
    --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
    --rdzv_id "$SLURM_JOB_ID"
    --rdzv_conf "join_timeout=$join_timeout,read_timeout=$read_timeout"
    --max-restarts "$max_restarts"
    "$target" "$@"
  )
  local -a launcher=(srun --ntasks-per-node=1 --kill-on-bad-exit=1)

  if hetero_dry_run; then
    local line i
    line=$(hetero_quote "${cmd[@]}")
    echo "# dry run: $(hetero_quote "${launcher[@]}") would start on each node, with" \
      "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT OMP_NUM_THREADS=$OMP_NUM_THREADS" \
      "TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG=$NCCL_DEBUG:" >&2
    for i in "${!hosts[@]}"; do
      echo "[node $i ${hosts[i]}] $line"
    done
    return 0
  fi
  command -v srun >/dev/null 2>&1 || hetero_die "srun not found: submit with sbatch, or set HETERO_DRY_RUN=1 to print the commands"
  exec "${launcher[@]}" "${cmd[@]}"
}

