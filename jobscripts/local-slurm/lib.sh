# What the one-node (start.sh, stop.sh) and the multi-node (cluster.sh) test Slurms share.
# Sourced, not run.

# Run "${@:2}" every 0.2 s until it succeeds or $1 seconds have passed; its status. The limits
# are seconds, not tries: on a machine busy with other jobs a daemon takes seconds to answer.
wait_until() {
  local limit=$1 start=$SECONDS
  shift
  until "$@"; do
    ((SECONDS - start < limit)) || return 1
    sleep 0.2
  done
}

# Whether the daemon whose pid is in file $1 runs.
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Stop the daemon whose pid is in file $1 (TERM, then KILL after 10 s) and forget the pid file.
stop_pid() {
  local pidfile=$1 pid
  [[ -s $pidfile ]] || return 0
  pid=$(cat "$pidfile")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

# The scheduling lines of both slurm.conf files: processes tracked by /proc, no task plugin, no
# default MPI plugin, backfill over CPUs; a node may claim more CPUs than it has instead of
# being drained (config_overrides), and a node that was down returns when it answers again.
slurm_conf_scheduling() {
  cat <<'CONF'
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
CONF
}
