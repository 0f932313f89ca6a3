#!/usr/bin/env bash
# Stop the one-node test Slurm that start.sh started: slurmd, slurmctld, and munged only if
# start.sh started it. Config and state stay in $HPC_SLURM_DIR (remove it for a clean slate).
set -uo pipefail

DIR=${HPC_SLURM_DIR:-/tmp/hpc-slurm}

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # stop_pid

stop_pid "$DIR/slurmd.pid"
stop_pid "$DIR/slurmctld.pid"
stop_pid "$DIR/munged.pid"
echo "local Slurm stopped (config and state kept in $DIR)"
