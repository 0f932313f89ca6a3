#!/usr/bin/env bash
# How often a rank dies inside MPI_Init under srun --mpi=pmix, without this package: a simulated
# two-node cluster of its own (cluster.sh) runs tests/mpi/init_race.py (every rank sends to every
# other at once after MPI_Init) again and again under each SETTING, and counts the outcomes.
#
#   jobscripts/local-slurm/init-race.sh [--runs N] [--layouts "2x2 2x4"] [--load N]
#                                       [--python PY] [--timeout S] [SETTING ...]
#
#   SETTING   default (the environment as the job scripts set it), or VAR=value[,VAR=value...]
#             added to it for srun and the ranks, e.g. OMPI_MCA_pmix_base_collect_data=0 or
#             SLURM_PMIX_DIRECT_CONN=false (Slurm's mpi.conf keys as per-step variables)
#   --runs    sruns per setting and layout (default 100), interleaved: run i of every setting
#             and layout before run i+1 of any, so load and drift fall on all alike
#   --layouts NODESxRANKS_PER_NODE list (default "2x2 2x4")
#   --load    busy processes (yes >/dev/null) beside the runs, as on a loaded CI machine
#             (default 0)
#   --python  the interpreter whose mpi4py the ranks use (default .venv/bin/python: the pip
#             wheel's Open MPI); one whose mpi4py is built against another MPI tests that one
#   --timeout seconds after which a run counts as hung and is killed (default 60)
#
# Prints one line per setting and layout: runs, completed, segfaults (a rank killed by SIGSEGV),
# hangs (srun still running after --timeout) and other failures; the first log of each failing
# kind is kept in $HPC_CLUSTER_DIR/logs. Needs root and what cluster.sh needs. The cluster has
# its own subnet, port, names and folder (HPC_CLUSTER_NET=10.221.40, HPC_CLUSTER_PORT=6977,
# HPC_CLUSTER_PREFIX=hpcrace, HPC_CLUSTER_DIR=/tmp/hpc-init-race), apart from the tests'
# clusters, and is taken down at the end, also when interrupted.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CLUSTER=$REPO/jobscripts/local-slurm/cluster.sh
SCRIPT=$REPO/tests/mpi/init_race.py
runs=100 layouts="2x2 2x4" load=0 python=$REPO/.venv/bin/python timeout=60
settings=()
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --layouts) layouts=$2; shift 2 ;;
    --load) load=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "init-race.sh: unknown option $1" >&2; exit 2 ;;
    *) settings+=("$1"); shift ;;
  esac
done
((${#settings[@]})) || settings=(default)
for setting in "${settings[@]}"; do
  [[ $setting == default || $setting =~ ^[A-Za-z_][A-Za-z0-9_]*=[^,]*(,[A-Za-z_][A-Za-z0-9_]*=[^,]*)*$ ]] ||
    { echo "init-race.sh: a SETTING is default or VAR=value[,VAR=value...]: $setting" >&2; exit 2; }
done
max_per_node=1
for layout in $layouts; do
  [[ $layout =~ ^([0-9]+)x([0-9]+)$ ]] ||
    { echo "init-race.sh: a layout is NODESxRANKS_PER_NODE: $layout" >&2; exit 2; }
  ((BASH_REMATCH[2] > max_per_node)) && max_per_node=${BASH_REMATCH[2]}
  ((BASH_REMATCH[1] <= 2)) || { echo "init-race.sh: the cluster has 2 nodes: $layout" >&2; exit 2; }
done
[[ -x $python ]] || { echo "init-race.sh: no python $python (make venv)" >&2; exit 2; }

export HPC_CLUSTER_NET=${HPC_CLUSTER_NET:-10.221.40} HPC_CLUSTER_PORT=${HPC_CLUSTER_PORT:-6977}
export HPC_CLUSTER_PREFIX=${HPC_CLUSTER_PREFIX:-hpcrace} HPC_CLUSTER_DIR=${HPC_CLUSTER_DIR:-/tmp/hpc-init-race}
export HPC_CLUSTER_NODES=2 HPC_CLUSTER_CPUS=$max_per_node
# What the job scripts and the tests give the ranks (jobscripts/slurm/common.sh, conftest.py).
for var in $(compgen -e | grep -E '^(SLURM_|SBATCH_|OMPI_MCA_|PMIX_MCA_)' || true); do unset "$var"; done
export SLURM_CONF=$HPC_CLUSTER_DIR/slurm.conf OMP_NUM_THREADS=1 PMIX_MCA_psec=native
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi

busy=()
finish() {
  local pid
  for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null || true; done
  bash "$CLUSTER" down >/dev/null 2>&1 || true
  bash "$CLUSTER" check >&2 || true
}
trap finish EXIT
trap 'exit 130' INT TERM
bash "$CLUSTER" up >/dev/null
rm -rf "$HPC_CLUSTER_DIR/logs"
mkdir -p "$HPC_CLUSTER_DIR/logs"
for ((i = 0; i < load; i++)); do
  yes >/dev/null &
  busy+=($!)
done

declare -A count
version=
start=$SECONDS
for ((run = 1; run <= runs; run++)); do
  for layout in $layouts; do
    nodes=${layout%x*} per_node=${layout#*x}
    for s in "${!settings[@]}"; do
      setting=${settings[$s]} vars=()
      [[ $setting == default ]] || IFS=, read -ra vars <<<"$setting"
      log=$HPC_CLUSTER_DIR/logs/run
      rc=0
      env "${vars[@]}" timeout -k 10 "$timeout" srun --mpi=pmix --kill-on-bad-exit=1 --nodes="$nodes" \
        --ntasks-per-node="$per_node" "$python" "$SCRIPT" >"$log.out" 2>"$log.err" || rc=$?
      if ((rc == 0)); then
        kind=ok
        [[ -n $version ]] || version=$(head -1 "$log.out")
      elif grep -q "Segmentation fault" "$log.err"; then kind=segv
      elif ((rc == 124 || rc == 137)); then kind=hang
      else kind=other
      fi
      key="$s $layout"
      count[$key $kind]=$((${count[$key $kind]:-0} + 1))
      if [[ $kind != ok && ! -e $HPC_CLUSTER_DIR/logs/$s-$layout-$kind.err ]]; then
        cp "$log.err" "$HPC_CLUSTER_DIR/logs/$s-$layout-$kind.err"
        cp "$log.out" "$HPC_CLUSTER_DIR/logs/$s-$layout-$kind.out"
      fi
    done
  done
  if ((run % 10 == 0)); then
    echo "init-race.sh: $run of $runs rounds, $((SECONDS - start)) s" >&2
  fi
done

echo "MPI: ${version:-no run completed} ($python); $(srun --version); load: $load busy processes;" \
     "$(nproc --all) CPUs; $((SECONDS - start)) s"
printf '%-60s %-6s %5s %5s %5s %5s %5s\n' setting layout runs ok segv hang other
for s in "${!settings[@]}"; do
  for layout in $layouts; do
    key="$s $layout"
    printf '%-60s %-6s %5d %5d %5d %5d %5d\n' "${settings[$s]}" "$layout" "$runs" \
      "${count[$key ok]:-0}" "${count[$key segv]:-0}" "${count[$key hang]:-0}" "${count[$key other]:-0}"
  done
done
