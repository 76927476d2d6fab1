#!/usr/bin/env bash
# Tear down the cluster that scripts/ci/slurm_up.sh PREFIX started.
#
#   scripts/ci/slurm_down.sh PREFIX
#
# Cancels its jobs, then stops exactly the daemons recorded in PREFIX/run/*.pid (SIGTERM, up to
# 15 s, then SIGKILL): slurmd, slurmctld, and munged only when slurm_up.sh started it. Job steps
# that outlive slurmd are found by the PREFIX/log/slurmd.log they hold open.
# Safe to run on a cluster that is already down, or was never up. Logs and state stay in PREFIX.
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 PREFIX" >&2; exit 2; }
if [[ ! -d $1 ]]; then
    echo "slurm_down: $1 does not exist; nothing to stop"
    exit 0
fi
PREFIX=$(cd "$1" && pwd -P)
RUN=$PREFIX/run
export PATH=$PATH:/usr/sbin:/sbin
export SLURM_CONF=$PREFIX/slurm.conf

# recorded_pid NAME: the pid in RUN/NAME.pid if it still runs NAME (a reused pid is left alone).
recorded_pid() {
    local pid
    pid=$(cat "$RUN/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]] && echo "$pid"
}
# marked_steps: slurmstepd processes of this cluster. Each holds this cluster's slurmd log open
# (its environment is blanked when it renames itself, so that cannot mark it).
marked_steps() {
    local p fd
    for p in $(pgrep -x slurmstepd); do
        for fd in /proc/"$p"/fd/*; do
            if [[ $(readlink "$fd" 2>/dev/null) == "$PREFIX/log/slurmd.log" ]]; then
                echo "$p"
                break
            fi
        done
    done
    return 0
}
# tree PID...: the pids and all their descendants.
tree() {
    local p c
    for p in "$@"; do
        echo "$p"
        for c in $(ps -o pid= --ppid "$p" 2>/dev/null); do tree "$c"; done
    done
}
# running PID: alive and not a zombie (an orphan's reaper may be slow, or absent in a container).
running() { [[ -e /proc/$1 ]] && [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) != Z ]]; }
# stop NAME PID...: SIGTERM, wait up to 15 s, SIGKILL whatever is left.
stop() {
    local what=$1 p left
    shift
    (($#)) || return 0
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 75); do
        left=()
        for p in "$@"; do running "$p" && left+=("$p"); done
        ((${#left[@]})) || { echo "slurm_down: stopped $what"; return 0; }
        sleep 0.2
    done
    kill -KILL "${left[@]}" 2>/dev/null || true
    echo "slurm_down: killed $what (pids ${left[*]}) after 15 s"
}

ctld=$(recorded_pid slurmctld || true)
slurmd=$(recorded_pid slurmd || true)

# slurmstepd (and so the job's processes) survive slurmd: cancel the jobs while slurmd can still
# act on it, and give the steps up to 15 s to end.
if [[ -n $ctld && -n $slurmd ]]; then
    jobs=$(squeue -h -o %A 2>/dev/null || true)
    if [[ -n $jobs ]]; then
        # shellcheck disable=SC2086  # one job id per word
        scancel $jobs 2>/dev/null || true
        for _ in $(seq 75); do
            [[ -z $(squeue -h -o %A 2>/dev/null || true) && -z $(marked_steps) ]] && break
            sleep 0.2
        done
    fi
fi
# Steps still there: kill them with everything under them, tasks first.
mapfile -t steps < <(marked_steps)
if ((${#steps[@]})); then
    mapfile -t procs < <(tree "${steps[@]}" | tac)
    kill -KILL "${procs[@]}" 2>/dev/null || true
    echo "slurm_down: killed ${#steps[@]} leftover job step(s): ${procs[*]}"
fi

daemons=()
[[ -n $slurmd ]] && daemons+=("$slurmd")
[[ -n $ctld ]] && daemons+=("$ctld")
if ((${#daemons[@]})); then
    stop "slurmd/slurmctld" "${daemons[@]}"
else
    echo "slurm_down: slurmctld and slurmd from $PREFIX are not running"
fi
# munged last (slurm daemons talk to it while stopping), and only when slurm_up.sh started it.
if munged=$(recorded_pid munged); then
    stop munged "$munged"
fi
rm -f "$RUN"/slurmctld.pid "$RUN"/slurmd.pid "$RUN"/munged.pid
