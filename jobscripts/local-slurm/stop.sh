#!/usr/bin/env bash
# Stop the one-node test Slurm that start.sh started: slurmd, slurmctld, and munged only if
# start.sh started it. Config and state stay in $HPC_SLURM_DIR (remove it for a clean slate).
set -uo pipefail

DIR=${HPC_SLURM_DIR:-/tmp/hpc-slurm}

# Stop the daemon whose pid is in $1 (TERM, then KILL after 10 s) and forget the pid file.
stop() {
  local pidfile=$1 pid
  [[ -s $pidfile ]] || return 0
  pid=$(cat "$pidfile")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$pidfile"
}

stop "$DIR/slurmd.pid"
stop "$DIR/slurmctld.pid"
stop "$DIR/munged.pid"
echo "local Slurm stopped (config and state kept in $DIR)"
