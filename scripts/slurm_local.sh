#!/usr/bin/env bash
# A throw-away Slurm cluster on this machine, for tests/slurm/ (`make test-slurm`).
#
#   scripts/slurm_local.sh start [DIR]   start slurmctld and two slurmd (2 CPUs each); print DIR
#   scripts/slurm_local.sh stop DIR      cancel its jobs, end every daemon it started, remove DIR
#
# DIR (default: a new temporary folder) holds slurm.conf, the state, spool and log folders,
# and DIR/env, which the tests source: it exports SLURM_CONF and puts DIR/bin (an `sacct`
# stand-in, below) first on PATH. No systemd, no munge (auth/none, cred/none), no accounting.
# Two nodes share this host, each slurmd on its own port (`slurmd -N NAME`): their names are
# this host's name and `localhost`, so a job's first node name resolves as on a real
# cluster (llm.launch takes MASTER_ADDR from it). `srun -N2 -n2` puts one task on each.
#
# Only what `start` started is ended: every daemon carries SLURM_LOCAL_DIR=DIR in its
# environment (slurmstepd inherits it), and `stop` signals those processes by id.
set -euo pipefail

die() { echo "slurm_local: $*" >&2; exit 1; }

start() {
  for cmd in slurmctld slurmd sinfo srun sbatch scontrol; do
    command -v "$cmd" >/dev/null \
      || die "slurm is not installed ($cmd not found): apt-get install -y slurm-wlm"
  done
  local dir=${1:-$(mktemp -d "${TMPDIR:-/tmp}/slurm_local.XXXXXX")}
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [[ -e $dir/slurm.conf ]] && die "$dir already holds a cluster: stop it first"
  mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/bin"
  local host ports
  host=$(hostname -s)
  [[ $host != localhost ]] || die "this host is named localhost: the two nodes need two names"
  # Three free ports: slurmctld and the two slurmd.
  ports=$(python3 -c '
import socket
ss = [socket.socket() for _ in range(3)]
for s in ss:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))')
  read -r ctld_port port1 port2 <<<"$ports"
  cat >"$dir/slurm.conf" <<EOF
# Written by scripts/slurm_local.sh: a one-host test cluster of two nodes.
ClusterName=llmlocal
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# Quick turnarounds: jobs stay visible to scontrol for 10 minutes after they end, steps
# are killed 5 s after their SIGTERM, and a requeued job may start again at once.
MinJobAge=600
KillWait=5
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=1,bf_interval=1
NodeName=$host NodeHostname=$host NodeAddr=127.0.0.1 Port=$port1 CPUs=2 State=UNKNOWN
NodeName=localhost NodeHostname=$host NodeAddr=127.0.0.1 Port=$port2 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  # submitit polls `sacct` for job states; without slurmdbd there is no sacct, so this
  # stand-in answers from `scontrol show job` (jobs stay there MinJobAge seconds).
  cat >"$dir/bin/sacct" <<'EOF'
#!/usr/bin/env python3
"""sacct -o JobID,State,NodeList --parsable2 -j ID [-j ID ...], from scontrol (no slurmdbd)."""
import subprocess
import sys

args = sys.argv[1:]
ids = [args[i + 1] for i, a in enumerate(args) if a == "-j"]
print("JobID|State|NodeList")
for jid in ids:
    out = subprocess.run(["scontrol", "-o", "show", "job", jid], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "ArrayTaskId" in f:
            name = f"{f['ArrayJobId']}_{f['ArrayTaskId']}"
        else:
            name = f["JobId"]
        print(f"{name}|{f.get('JobState', 'UNKNOWN')}|{f.get('NodeList', '')}")
EOF
  chmod +x "$dir/bin/sacct"
  cat >"$dir/env" <<EOF
export SLURM_CONF=$dir/slurm.conf
export PATH=$dir/bin:\$PATH
EOF
  export SLURM_CONF=$dir/slurm.conf
  # slurmctld -i: ignore any saved state; both daemons fork into the background.
  local daemon
  for daemon in "slurmctld -i" "slurmd -N $host" "slurmd -N localhost"; do
    # shellcheck disable=SC2086
    env SLURM_LOCAL_DIR="$dir" $daemon || failed_start "$dir" "$daemon did not start"
  done
  local idle=""
  for _ in $(seq 100); do
    idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
    [[ $idle == 2 ]] && break
    sleep 0.2
  done
  [[ $idle == 2 ]] || failed_start "$dir" "the nodes did not become idle in 20 s"
  echo "$dir"
}

# One line naming what failed and its logs (kept in a copy); nothing left running.
failed_start() {
  local logs
  logs=$(mktemp -d "${TMPDIR:-/tmp}/slurm_local_logs.XXXXXX")
  cp -r "$1/log/." "$logs/" 2>/dev/null || true
  stop "$1" >/dev/null 2>&1 || true
  die "$2 (logs: $logs)"
}

# The processes started from DIR: the daemons (each carries SLURM_LOCAL_DIR=DIR in its
# environment, slurmstepd too) and everything below them (job scripts, srun tasks).
ours() {
  local dir=$1 pid roots=()
  for pid in /proc/[0-9]*; do
    pid=${pid#/proc/}
    [[ $pid == "$$" ]] && continue
    if grep -sqxzF "SLURM_LOCAL_DIR=$dir" "/proc/$pid/environ"; then
      roots+=("$pid")
    fi
  done
  ((${#roots[@]})) || return 0
  ps -eo pid=,ppid= | awk -v roots="${roots[*]}" '
    BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
    { parent[$1] = $2 }
    END {
      for (p in parent) { q = p; while (q in parent && !(q in keep) && q > 1) q = parent[q]; if (q in keep) print p }
    }'
}

stop() {
  local dir=${1:?usage: slurm_local.sh stop DIR}
  dir=$(cd "$dir" 2>/dev/null && pwd) || { echo "slurm_local: no cluster in $1"; return 0; }
  [[ -e $dir/slurm.conf ]] || die "$dir holds no cluster of slurm_local.sh"
  export SLURM_CONF=$dir/slurm.conf
  if [[ -n $(ours "$dir") ]]; then
    # Jobs first, while slurmd can still end their steps.
    scancel --full --quiet --user "$(id -un)" 2>/dev/null || true
    for _ in $(seq 150); do
      [[ -z $(squeue -h -t R,CG,PD,CF,S 2>/dev/null) ]] && break
      sleep 0.2
    done
  fi
  local pids
  for sig in TERM KILL; do
    pids=$(ours "$dir")
    [[ -z $pids ]] && break
    # shellcheck disable=SC2086
    kill -s "$sig" $pids 2>/dev/null || true
    for _ in $(seq 50); do
      pids=$(ours "$dir")
      [[ -z $pids ]] && break
      sleep 0.2
    done
  done
  [[ -z $(ours "$dir") ]] || die "processes of $dir would not end: $(ours "$dir")"
  rm -rf "$dir"
}

case ${1:-} in
  start) start "${2:-}" ;;
  stop) stop "${2:-}" ;;
  *) die "usage: slurm_local.sh start [DIR] | stop DIR" ;;
esac
