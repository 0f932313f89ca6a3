#!/usr/bin/env bash
# A simulated multi-node Slurm cluster on this one machine, for trying the job scripts across
# nodes and for the tests. Each node is a network + UTS + mount namespace with its own host name
# (node1, node2, ...), its own /etc/hosts and a private /tmp, joined to a bridge in the root
# namespace by a veth pair; the root namespace is the login node (sbatch, srun, squeue) and runs
# slurmctld and munged; every node runs its own slurmd. Addresses come from a private subnet that
# exists only on this machine (no route leaves it). Run as root (CAP_SYS_ADMIN, CAP_NET_ADMIN).
#
#   cluster.sh up            start it (a running cluster in $HPC_CLUSTER_DIR is torn down first)
#   cluster.sh down          stop every daemon, unmount, delete namespaces, bridge and veths
#   cluster.sh exec NODE CMD run CMD on NODE (inside its namespaces, as a login there would)
#   cluster.sh rsh NODE LINE run the shell command line LINE on NODE: an ssh stand-in, e.g.
#                            mpirun --host node1:2,node2:2 --mca plm_rsh_agent "cluster.sh rsh"
#   cluster.sh check         exit 0 when nothing of a cluster is left (daemons, netns, links)
#
#   HPC_CLUSTER_DIR=/tmp/hpc-cluster  config, state, logs, per-node /tmp and /etc/hosts; shared
#                                     by every node at the same path: put run folders under it
#   HPC_CLUSTER_NODES=2               number of nodes
#   HPC_CLUSTER_CPUS=4                CPUs each node claims
#   HPC_CLUSTER_GPUS=2                stand-in GPUs each node claims (empty device files)
#   HPC_CLUSTER_NET=10.221.0          the /24 of the bridge (.1, the login node) and nodes (.11+)
#   HPC_CLUSTER_PORT=6917             slurmctld's port; slurmd listens on the next one (the
#                                     one-node test Slurm of start.sh keeps 6817/6818)
#   HPC_CLUSTER_SLURMD_TIMEOUT=30     seconds before a silent node is DOWN (SlurmdTimeout)
#   HPC_CLUSTER_PREFIX=hpcsim         names of its namespaces and links (two clusters at once)
#   HPC_CLUSTER_SHARE="DIR ..."       more folders under /tmp every node must see (the rest of
#                                     /tmp is private to each node)
#
# A node's /etc/hosts is $HPC_CLUSTER_DIR/NODE/hosts, bind-mounted: edit it in place (not by
# replacing the file) to make names lie. Entering a node: nsenter --net=/run/netns/PREFIX-NODE
# plus the UTS and mount namespaces of its holder process (not `ip netns exec`, which remounts
# /sys, hides /sys/fs/cgroup and slurmd then refuses to start).
set -euo pipefail

DIR=${HPC_CLUSTER_DIR:-/tmp/hpc-cluster}
NODES=${HPC_CLUSTER_NODES:-2}
CPUS=${HPC_CLUSTER_CPUS:-4}
GPUS=${HPC_CLUSTER_GPUS:-2}
NET=${HPC_CLUSTER_NET:-10.221.0}
PORT=${HPC_CLUSTER_PORT:-6917}
SLURMD_TIMEOUT=${HPC_CLUSTER_SLURMD_TIMEOUT:-30}
SHARE=${HPC_CLUSTER_SHARE:-}
# names of the namespaces (hpcsim-node1) and links (hpcsim-br, hpcsim-v1); at most 8 characters
PREFIX=${HPC_CLUSTER_PREFIX:-hpcsim}
BRIDGE=$PREFIX-br
LOGIN=$(hostname -s)
export SLURM_CONF=$DIR/slurm.conf
PATH=$PATH:/usr/sbin:/sbin

die() { echo "cluster.sh: $*" >&2; exit 1; }
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # alive, stop_pid, slurm_conf_scheduling
nodes() { seq -f "node%g" 1 "$NODES"; }
holder() { cat "$DIR/$1/holder.pid" 2>/dev/null; }

# Run "$@" inside NODE's network, UTS and mount namespaces.
on_node() {
  local node=$1 pid
  shift
  pid=$(holder "$node") && kill -0 "$pid" 2>/dev/null || die "$node is not up"
  nsenter --net="/run/netns/$PREFIX-$node" --uts=/proc/"$pid"/ns/uts \
    --mount=/proc/"$pid"/ns/mnt --wd="$PWD" -- "$@"
}

down() {
  local node pid ns
  [[ -d $DIR ]] || return 0
  for node in $(ls "$DIR" | grep -E '^node[0-9]+$' || true); do
    # Every process left in the node (slurmd, slurmstepd, job ranks) dies with it.
    if [[ -e /run/netns/$PREFIX-$node ]]; then
      for pid in $(ip netns pids "$PREFIX-$node" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    fi
    stop_pid "$DIR/$node/holder.pid"
  done
  stop_pid "$DIR/slurmctld.pid"
  stop_pid "$DIR/munge/munged.pid"
  for ns in $(ip netns list | awk -v p="$PREFIX-" 'index($1, p) == 1 {print $1}'); do
    ip netns del "$ns"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  # A veth left in the root namespace by an interrupted start.
  for ns in $(ip -o link show | awk -F': ' -v p="$PREFIX-v" 'index($2, p) == 1 {sub(/@.*/, "", $2); print $2}'); do
    ip link del "$ns" 2>/dev/null || true
  done
}

check() {
  local left
  left=$(ip netns list | grep -c "^$PREFIX-" || true)
  ((left == 0)) || die "$left namespace(s) left: $(ip netns list | grep "^$PREFIX-" | tr '\n' ' ')"
  ! ip -o link show | grep -q "$PREFIX-" || die "links left: $(ip -o link show | grep "$PREFIX-")"
  ! grep -q " $DIR/" /proc/self/mountinfo || die "mounts left under $DIR"
  local pidfile
  for pidfile in "$DIR"/slurmctld.pid "$DIR"/munge/munged.pid "$DIR"/node*/holder.pid; do
    [[ -e $pidfile ]] && die "daemon left: $pidfile"
  done
  echo "no simulated cluster left"
}

write_config() {
  local node i
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=hpc-sim
SlurmctldHost=$LOGIN($NET.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/%n/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/%n/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/%n/slurmd.log
$(slurm_conf_scheduling)
# A node that stops answering is DOWN after this (Slurm's default is 300 s), its jobs requeued.
SlurmdTimeout=$SLURMD_TIMEOUT
MessageTimeout=10
MinJobAge=3600
GresTypes=gpu
EOF
  i=0
  for node in $(nodes); do
    i=$((i + 1))
    echo "NodeName=$node NodeAddr=$NET.$((10 + i)) CPUs=$CPUS Gres=gpu:$GPUS State=UNKNOWN" >>"$DIR/slurm.conf"
  done
  echo "PartitionName=sim Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP" >>"$DIR/slurm.conf"
  : >"$DIR/gres.conf"
  for node in $(nodes); do
    echo "NodeName=$node Name=gpu File=$DIR/$node/gpu[0-$((GPUS - 1))]" >>"$DIR/gres.conf"
  done
}

# /etc/hosts of every node: localhost, the login node and every node by its address.
write_hosts() {
  local node=$1 other i=0
  {
    echo "127.0.0.1 localhost"
    echo "$NET.1 $LOGIN"
    for other in $(nodes); do
      i=$((i + 1))
      echo "$NET.$((10 + i)) $other"
    done
  } >"$DIR/$node/hosts"
}

start_munge() {
  mkdir -p "$DIR/munge"
  chmod 0700 "$DIR/munge"
  [[ -s $DIR/munge/munge.key ]] || mungekey --create --keyfile="$DIR/munge/munge.key" >/dev/null
  chmod 0400 "$DIR/munge/munge.key"
  munged --force --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
  wait_until 60 munge_answers || die "munged does not answer (see $DIR/munge/munged.log)"
}

munge_answers() {
  munge -S "$DIR/munge/munge.socket.2" -n 2>/dev/null |
    unmunge -S "$DIR/munge/munge.socket.2" >/dev/null 2>&1
}

# Node $1's network namespace with address $2 on eth0, a veth to the bridge.
start_net() {
  local node=$1 addr=$2 k=${1#node}
  ip netns add "$PREFIX-$node"
  ip link add "$PREFIX-v$k" type veth peer name eth0 netns "$PREFIX-$node"
  ip link set "$PREFIX-v$k" master "$BRIDGE" up
  ip -n "$PREFIX-$node" addr add "$addr/24" dev eth0
  ip -n "$PREFIX-$node" link set eth0 up
  ip -n "$PREFIX-$node" link set lo up
}

# Node $1's holder process, which owns the node's UTS and mount namespaces (host name,
# /etc/hosts, private /tmp with the shared folders bound back in at their own paths, and a
# /dev/shm of its own, as a real node has: MPI's shared-memory segments are named after the
# job and the host, so two clusters' jobs of the same id on their node1 would share them).
# Started once every node's network namespace exists, so that each mount namespace sees them
# all.
start_node() {
  local node=$1 path
  mkdir -p "$DIR/$node/tmp" "$DIR/$node/spool"
  chmod 1777 "$DIR/$node/tmp"
  touch $(seq -f "$DIR/$node/gpu%g" 0 $((GPUS - 1)))
  write_hosts "$node"
  local binds=""
  for path in $DIR $SHARE; do
    [[ $path == /tmp/* ]] || continue
    binds+="mkdir -p '$path'; mount --no-canonicalize --bind '/proc/self/fd/9/${path#/tmp/}' '$path'; "
  done
  nsenter --net="/run/netns/$PREFIX-$node" -- unshare --uts --mount --propagation private -- \
    bash -c "set -e; hostname $node; mount --bind '$DIR/$node/hosts' /etc/hosts
             exec 9</tmp; mount --bind '$DIR/$node/tmp' /tmp; $binds exec 9<&-
             mount -t tmpfs -o mode=1777 shm /dev/shm
             touch '$DIR/$node/ready'; exec sleep infinity" \
    </dev/null >"$DIR/$node/holder.log" 2>&1 &
  echo $! >"$DIR/$node/holder.pid"
  wait_until 60 node_ready "$node" && [[ -e $DIR/$node/ready ]] ||
    die "$node did not come up: $(cat "$DIR/$node/holder.log")"
}

# Whether node $1's holder is ready, or has ended (then it never will be).
node_ready() {
  [[ -e $DIR/$1/ready ]] || ! kill -0 "$(holder "$1")" 2>/dev/null
}

node_states() { sinfo -h -o %t 2>/dev/null | sort -u | tr '\n' ' '; }
nodes_idle() { [[ $(node_states) == "idle " ]]; }

up() {
  [[ $(id -u) == 0 ]] || die "run as root (namespaces, links, slurmd)"
  for cmd in munged mungekey slurmctld slurmd sinfo sbatch nsenter unshare ip; do
    command -v "$cmd" >/dev/null ||
      die "$cmd not found: apt-get install munge slurmctld slurmd slurm-client"
  done
  down
  rm -rf "$DIR/state" "$DIR"/node*
  mkdir -p "$DIR/state"
  start_munge
  write_config
  ip link add "$BRIDGE" type bridge
  ip addr add "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local node i=0
  for node in $(nodes); do
    i=$((i + 1))
    start_net "$node" "$NET.$((10 + i))"
  done
  for node in $(nodes); do
    start_node "$node"
  done
  slurmctld
  for node in $(nodes); do
    on_node "$node" slurmd
  done
  if ! wait_until 180 nodes_idle; then
    local states
    states=$(node_states)
    die "nodes are '${states:-not registered}' (logs: $DIR/*.log $DIR/node*/*.log)"
  fi
  cat <<EOF
Simulated cluster up: $NODES nodes (node[1-$NODES], $CPUS CPUs and $GPUS stand-in GPUs each),
partition sim, login node $LOGIN ($NET.1). Use it with:
  export SLURM_CONF=$SLURM_CONF
  sinfo
  sbatch --chdir=\$PWD --nodes=2 --ntasks-per-node=2 --gpus-per-node=2 --output=$DIR/%x-%j.out \\
    --export=ALL,RUN_ROOT=$DIR/runs jobscripts/slurm/sft.sbatch model.path=toy sft.steps=2
Run folders must be under $DIR (or HPC_CLUSTER_SHARE): the rest of /tmp is private per node.
Stop it with: $0 down
EOF
}

case ${1:-} in
  up) up ;;
  down) down; echo "simulated cluster down" ;;
  exec) shift; node=${1:?node}; shift; on_node "$node" "$@" ;;
  rsh) shift; node=${1:?node}; shift; on_node "$node" bash -c "$*" ;;
  check) check ;;
  *) echo "usage: $0 up|down|exec NODE CMD...|rsh NODE LINE|check" >&2; exit 2 ;;
esac
