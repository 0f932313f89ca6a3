#!/usr/bin/env bash
# Start a one-node test Slurm on this machine (Debian's munge, slurmctld, slurmd, slurm-client),
# for the tests and for trying the job scripts. Idempotent: what already runs is reused.
# Run as root (slurmd must be able to start jobs as any user). Everything Slurm writes
# (config, state, spool, logs, pid files) lives in $HPC_SLURM_DIR (default /tmp/hpc-slurm),
# so the machine's own /etc/slurm is never touched; clients find it through SLURM_CONF.
#
#   HPC_SLURM_DIR=/tmp/hpc-slurm   where the config and state go
#   HPC_SLURM_CPUS=8               CPUs the node claims (more than it has, so 4-rank jobs fit)
#   HPC_SLURM_GPUS=8               stand-in GPUs the node claims (empty files in $DIR, as Slurm
#                                  wants a device file per GPU), so the job scripts' real
#                                  --gpus-per-node requests are accepted; jobs still run on CPU
set -euo pipefail

DIR=${HPC_SLURM_DIR:-/tmp/hpc-slurm}
CPUS=${HPC_SLURM_CPUS:-8}
GPUS=${HPC_SLURM_GPUS:-8}
HOST=$(hostname -s)
export SLURM_CONF=$DIR/slurm.conf
PATH=$PATH:/usr/sbin:/sbin   # the daemons live there; not every root shell has them on PATH

die() { echo "start.sh: $*" >&2; exit 1; }
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # alive, slurm_conf_scheduling

[[ $(id -u) == 0 ]] || die "run as root (slurmd starts jobs on behalf of users)"
for cmd in munged slurmctld slurmd sinfo sbatch; do
  command -v "$cmd" >/dev/null ||
    die "$cmd not found: apt-get install munge slurmctld slurmd slurm-client"
done
mkdir -p "$DIR/state" "$DIR/spool"

# munge: reuse a running daemon (e.g. the system's), else start one as the munge user, as the
# Debian service would; the pid file in $DIR tells stop.sh that it is ours to stop.
munge_answers() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_answers; then
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge   # normally made by systemd, absent in CI
  runuser -u munge -- munged --pid-file=/run/munge/munged.pid
  cp /run/munge/munged.pid "$DIR/munged.pid"
  wait_until 60 munge_answers
  munge -n | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# The config is rewritten each time and a running slurmctld is told to reread it.
# 127.0.0.1 as the address, because a container's hostname need not resolve.
# config_overrides: the node may claim more CPUs than it has instead of being drained.
cat >"$DIR/slurm.conf" <<EOF
ClusterName=hpc-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
$(slurm_conf_scheduling)
# No accounting database here: keep finished jobs visible to scontrol for an hour.
MinJobAge=3600
GresTypes=gpu
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
touch $(seq -f "$DIR/fake-gpu%g" 0 $((GPUS - 1)))
echo "NodeName=$HOST Name=gpu File=$DIR/fake-gpu[0-$((GPUS - 1))]" >"$DIR/gres.conf"

if alive "$DIR/slurmctld.pid"; then scontrol reconfigure; else slurmctld; fi
alive "$DIR/slurmd.pid" || slurmd

# Ready when the node is idle (or already running jobs); a node left down or drained by an
# earlier run is resumed.
state=
for _ in $(seq 180); do
  state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
  case $state in
    idle|mix|alloc) break ;;
    inval*) break ;;  # the node contradicts the config: see the logs
    down*|drain*) scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 1
done
[[ $state =~ ^(idle|mix|alloc)$ ]] ||
  die "node $HOST is '${state:-not registered}' (logs: $DIR/*.log)"

cat <<EOF
One-node Slurm up: node $HOST, $CPUS CPUs, $GPUS stand-in GPUs, partition debug.
Use it with:
  export SLURM_CONF=$SLURM_CONF
  sinfo
  PATH=\$PWD/.venv/bin:\$PATH OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
    LAUNCHER=mpirun sbatch --ntasks-per-node=2 --gpus-per-node=2 jobscripts/slurm/sft.sbatch \\
    sft.steps=2
LAUNCHER=srun (srun --mpi=pmix) also needs libpmix-dev: Slurm loads libpmix.so, which
Debian ships only there (install it before slurmd starts).
Stop it with: $(dirname "$0")/stop.sh
EOF
