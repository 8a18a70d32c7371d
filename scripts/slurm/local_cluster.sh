#!/usr/bin/env bash
# A one-host SLURM cluster on this machine, for the tests (tests/test_slurm.py) and for trying
# the templates beside this script: munged, slurmctld and slurmd, as root, from Debian's packages
# (apt-get install slurm-wlm munge).
#
#   scripts/slurm/local_cluster.sh start   # idempotent: a running cluster is left as it is
#   scripts/slurm/local_cluster.sh stop    # leaves none of the three daemons running
#   scripts/slurm/local_cluster.sh status
#
# The node is this host (`hostname -s`) with CPUs=2; processes are tracked through /proc
# (proctrack/linuxproc: no cgroups needed in a container), tasks are not bound (task/none), and
# jobs may be requeued (JobRequeue=1). The configuration goes to /etc/slurm/slurm.conf, where
# sbatch, srun and scontrol look for it; an existing file that this script did not write is kept
# and the script stops.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by fastpt scripts/slurm/local_cluster.sh"
STATE=/var/spool/fastpt-slurm
RUN=/run/fastpt-slurm

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
    local host mem
    host=$(hostname -s)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))  # half the memory, in MB
    if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
        echo "error: $CONF exists and was not written by this script; not touching it" >&2
        exit 2
    fi
    mkdir -p "$STATE/ctld" "$STATE/d" "$RUN"
    cat > "$CONF" <<CONF_END
$MARK
ClusterName=fastpt
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=10
NodeName=$host CPUs=2 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF_END
}

start() {
    command -v slurmctld >/dev/null || { echo "error: no slurmctld; apt-get install slurm-wlm munge" >&2; exit 2; }
    write_conf
    if ! pid_alive /run/munge/munged.pid; then
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        chown munge:munge /run/munge /var/log/munge /var/lib/munge
        [[ -f /etc/munge/munge.key ]] || runuser -u munge -- /usr/sbin/mungekey --create
        runuser -u munge -- /usr/sbin/munged
    fi
    pid_alive "$RUN/slurmctld.pid" || slurmctld
    pid_alive "$RUN/slurmd.pid" || slurmd
    for _ in $(seq 60); do  # the node comes up idle within seconds
        if sinfo -h -N -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
            sinfo
            return 0
        fi
        # A node left down or drained by an earlier run (a killed slurmd) is put back.
        scontrol update nodename="$(hostname -s)" state=resume 2>/dev/null || true
        sleep 1
    done
    echo "error: the node did not come up; see $STATE/slurmctld.log and $STATE/slurmd.log" >&2
    sinfo >&2 || true
    exit 1
}

stop_one() {  # pidfile: TERM, wait up to 20 s, then KILL
    local pidfile=$1 pid
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    rm -f "$pidfile"
}

stop() {
    if pid_alive "$RUN/slurmctld.pid"; then
        scancel --full "--user=$(id -un)" 2>/dev/null || true  # no job left to outlive the daemons
    fi
    stop_one "$RUN/slurmd.pid"
    stop_one "$RUN/slurmctld.pid"
    stop_one /run/munge/munged.pid
}

status() {
    for name in munge/munged fastpt-slurm/slurmctld fastpt-slurm/slurmd; do
        if pid_alive "/run/$name.pid"; then echo "${name#*/}: running"; else echo "${name#*/}: stopped"; fi
    done
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
