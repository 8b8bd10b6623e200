#!/usr/bin/env bash
# Multi-node throughput sweep: one sbatch job of slurm/bench.sbatch per node count, each writing
# results/bench_<N>nodes.json (its SLURM log beside it). Run from anywhere; arguments after -- go to the
# benchmark (hetero.bench.throughput), which gets --json from this script:
#   slurm/bench_sweep.sh --nodes 1,2,4,8 --gpus-per-node 8 -- experiment=mixed_vlm --steps 50
# --dry-run (or HETERO_DRY_RUN=1) prints each sbatch line and, for made-up hosts node1..nodeN, the command
# every node would run; nothing is submitted and no SLURM is needed.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source-path=SCRIPTDIR source=common.sh
source slurm/common.sh

usage() {
  cat <<'USAGE'
usage: slurm/bench_sweep.sh [--nodes 1,2,4,8] [--gpus-per-node G] [--results DIR] [--sbatch-arg ARG]...
                            [--dry-run] [-- BENCHMARK_ARGS...]
  --nodes          comma-separated node counts, one job each (default 1,2,4,8)
  --gpus-per-node  passed to sbatch as --gpus-per-node=G (default: the sbatch script's, GPUS_PER_NODE or 8)
  --results        directory for bench_<N>nodes.json and the job logs, relative to the repository (default results)
  --sbatch-arg     one extra sbatch option for every job, e.g. --sbatch-arg=--partition=gpu (repeatable)
  --dry-run        same as HETERO_DRY_RUN=1: print the sbatch lines and the per-node commands, submit nothing
USAGE
}

nodes_list=1,2,4,8
gpus_per_node=""
results=results
extra_sbatch=()
bench_args=()
while (($#)); do
  case $1 in
    --nodes) nodes_list=${2:?--nodes needs a value}; shift 2 ;;
    --nodes=*) nodes_list=${1#*=}; shift ;;
    --gpus-per-node) gpus_per_node=${2:?--gpus-per-node needs a value}; shift 2 ;;
    --gpus-per-node=*) gpus_per_node=${1#*=}; shift ;;
    --results) results=${2:?--results needs a value}; shift 2 ;;
    --results=*) results=${1#*=}; shift ;;
    --sbatch-arg) extra_sbatch+=("${2:?--sbatch-arg needs a value}"); shift 2 ;;
    --sbatch-arg=*) extra_sbatch+=("${1#*=}"); shift ;;
    --dry-run) export HETERO_DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; bench_args=("$@"); break ;;
    *) usage >&2; hetero_die "unknown option '$1' (benchmark arguments go after --)" ;;
  esac
done

# ${a[@]+"${a[@]}"}: an empty array under set -u on bash < 4.4 too.
for arg in ${bench_args[@]+"${bench_args[@]}"}; do
  if [[ $arg == --json || $arg == --json=* ]]; then
    hetero_die "the sweep sets --json itself ($results/bench_<N>nodes.json); choose the directory with --results"
  fi
done
[[ $nodes_list =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || hetero_die "--nodes must be a comma list of node counts like 1,2,4,8, got '$nodes_list'"
IFS=, read -r -a node_counts <<<"$nodes_list"
gpu_sbatch=()
if [[ -n $gpus_per_node ]]; then
  hetero_require_int --gpus-per-node "$gpus_per_node"
  gpu_sbatch=(--gpus-per-node="$gpus_per_node")
fi

if ! hetero_dry_run; then
  command -v sbatch >/dev/null 2>&1 || hetero_die "sbatch not found (--dry-run prints the jobs without SLURM)"
  mkdir -p "$results"
fi

for n in "${node_counts[@]}"; do
  json=$results/bench_${n}nodes.json
  job=(
    sbatch --nodes="$n" --job-name="hetero-bench-${n}n" --output="$results/bench_${n}nodes.%j.log"
    ${gpu_sbatch[@]+"${gpu_sbatch[@]}"} ${extra_sbatch[@]+"${extra_sbatch[@]}"}
    slurm/bench.sbatch ${bench_args[@]+"${bench_args[@]}"} --json "$json"
  )
  if hetero_dry_run; then
    echo "[sbatch nodes=$n] $(hetero_quote "${job[@]}")"
    # The per-node commands that job would run, on made-up hosts node1..nodeN (a job id is not known yet).
    if [[ -n $gpus_per_node ]]; then
      export SLURM_GPUS_ON_NODE=$gpus_per_node
    fi
    if ((n == 1)); then nodelist=node1; else nodelist="node[1-$n]"; fi
    SLURM_JOB_NODELIST=$nodelist SLURM_NNODES=$n SLURM_JOB_ID=JOBID \
      bash slurm/bench.sbatch ${bench_args[@]+"${bench_args[@]}"} --json "$json"
  else
    id=$(sbatch --parsable "${job[@]:1}")
    echo "submitted job ${id%%;*}: $n node(s) -> $json"
  fi
done
