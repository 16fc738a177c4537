#!/usr/bin/env bash
# A one-node SLURM cluster (Debian's slurmctld + slurmd + munge, SLURM 22.05) for the tests,
# run as root without systemd. Idempotent and pid-file based: it only ever signals the pids it
# wrote, never processes found by name.
#
#   tests/slurm_cluster.sh start     # prints `export SLURM_CONF=...` on success
#   tests/slurm_cluster.sh status
#   tests/slurm_cluster.sh stop
#
# State lives in $PRETRAIN_SLURM_DIR (default /tmp/pretrain-slurm). The node advertises 8 CPUs
# and 2 fake GPUs (gres.conf File= character devices made with mknod, which gives every task
# its CUDA_VISIBLE_DEVICES like real ones; plain files do not), whatever the machine has
# (SlurmdParameters=config_overrides). The main scheduling loop runs every second (sched_interval=1,
# its shortest): a job whose afterok dependency was just met, or a requeued job, waits for that loop,
# and a chain of 10 dependent jobs took 16-20 s with sched_interval=2 against 9 s with 1.
set -euo pipefail
DIR=${PRETRAIN_SLURM_DIR:-/tmp/pretrain-slurm}
HOST=$(hostname -s)
CONF=$DIR/etc/slurm.conf
export SLURM_CONF=$CONF

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_config() {
    mkdir -p "$DIR"/{etc,state,spool,log,munge,dev}
    chmod 755 "$DIR/munge"                       # munge refuses a socket dir others cannot traverse
    [[ -f $DIR/munge/munge.key ]] || { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none;
                                       chmod 600 "$DIR/munge/munge.key"; }
    for i in 0 1; do [[ -e $DIR/dev/nvidia$i ]] || mknod "$DIR/dev/nvidia$i" c 1 3; done
    cat > "$CONF" <<EOF
ClusterName=pretrain-test
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
MpiDefault=none
GresTypes=gpu
KillWait=10
MinJobAge=600
SchedulerParameters=sched_interval=1
NodeName=$HOST CPUs=8 RealMemory=16000 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    printf 'NodeName=%s Name=gpu File=%s\nNodeName=%s Name=gpu File=%s\n' \
        "$HOST" "$DIR/dev/nvidia0" "$HOST" "$DIR/dev/nvidia1" > "$DIR/etc/gres.conf"
    : > "$DIR/etc/cgroup.conf"
}

start() {
    command -v slurmctld >/dev/null || { echo "slurmctld not installed (apt-get install slurmctld slurmd slurm-client munge)" >&2; exit 3; }
    write_config
    alive "$DIR/munged.pid" || munged --force --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed"
    alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF"
    alive "$DIR/slurmd.pid" || slurmd -f "$CONF"
    for _ in $(seq 60); do
        if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        sleep 0.5
    done
    echo "the local SLURM cluster did not come up; logs in $DIR/log" >&2
    sinfo >&2 || true
    exit 1
}

stop() {
    for d in slurmd slurmctld munged; do
        if alive "$DIR/$d.pid"; then kill "$(cat "$DIR/$d.pid")"; fi
    done
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) for d in munged slurmctld slurmd; do alive "$DIR/$d.pid" && echo "$d up" || echo "$d down"; done
            sinfo 2>/dev/null || true ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
