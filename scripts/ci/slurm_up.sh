#!/usr/bin/env bash
# Bring up a single-node SLURM cluster on localhost, for tests, from nothing.
#
#   scripts/ci/slurm_up.sh PREFIX
#
# Installs Debian's slurm + munge if missing (needs root and apt-get), starts munged (unless one
# already answers), slurmctld and slurmd by hand (no systemd), with every file under PREFIX, waits
# until the node is idle, and prints on its LAST stdout line:
#
#   export SLURM_CONF=PREFIX/slurm.conf
#
# so `eval "$(scripts/ci/slurm_up.sh /tmp/slurm | tail -n 1)"` sets up the caller's clients.
# Stop it with scripts/ci/slurm_down.sh PREFIX. Exits 1 with one `slurm_up: ...` line on stderr
# when slurm cannot be installed or does not come up.
#
# Environment: SLURM_UP_CTLD_PORT (default 16817) and SLURM_UP_SLURMD_PORT (default 16818),
# fixed and away from the 6817/6818 a real cluster would use; SLURM_UP_CRED_EXPIRE (default 10,
# at least 5): how long a job credential lives, which also delays a requeued job's restart
# (cred_expire + ~2 s; slurm's default 120 s would make it ~2 min).
set -euo pipefail

die() { echo "slurm_up: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || die "usage: $0 PREFIX"
# slurm.conf has no quoting: a path with blanks would be cut at the first one.
[[ $1 != *[[:space:]]* ]] || die "PREFIX must not contain whitespace: '$1'"
mkdir -p "$1" || die "cannot create $1"
PREFIX=$(cd "$1" && pwd -P)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)

CTLD_PORT=${SLURM_UP_CTLD_PORT:-16817}
SLURMD_PORT=${SLURM_UP_SLURMD_PORT:-16818}
CRED_EXPIRE=${SLURM_UP_CRED_EXPIRE:-10}
# Slurm takes a value under 5 as invalid and silently falls back to 120 s.
[[ $CRED_EXPIRE =~ ^[0-9]+$ ]] && ((CRED_EXPIRE >= 5)) \
    || die "SLURM_UP_CRED_EXPIRE must be a whole number of seconds >= 5, not '$CRED_EXPIRE'"
PKGS=(slurmctld slurmd slurm-client munge)
CONF=$PREFIX/slurm.conf
RUN=$PREFIX/run LOG=$PREFIX/log STATE=$PREFIX/state SPOOL=$PREFIX/spool
# Daemons live in /usr/sbin, which a non-login PATH may lack.
export PATH=$PATH:/usr/sbin:/sbin
# Our own client calls below need it too (else "DNS SRV lookup failed").
export SLURM_CONF=$CONF

# pid_alive PIDFILE COMM: the recorded pid still runs the expected program (not a reused pid).
pid_alive() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]
}
munge_works() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
tails() {
    local f
    for f in "$LOG"/*; do
        [[ -s $f ]] || continue
        echo "----- tail $f" >&2
        tail -n 20 "$f" >&2
    done
}

# --- already up? ---------------------------------------------------------------------------
if pid_alive "$RUN/slurmctld.pid" slurmctld && pid_alive "$RUN/slurmd.pid" slurmd \
    && munge_works && scontrol ping 2>/dev/null | grep -q 'is UP'; then
    echo "slurm_up: cluster from $PREFIX is already up"
    echo "export SLURM_CONF=$CONF"
    exit 0
fi
# Half up (a daemon died, or a crash left pid files): stop what is left, then start afresh.
if compgen -G "$RUN/*.pid" >/dev/null; then
    echo "slurm_up: stopping a partial cluster from $PREFIX first"
    "$here/slurm_down.sh" "$PREFIX"
fi

# --- install -------------------------------------------------------------------------------
missing=()
for c in slurmctld slurmd sbatch munged; do
    command -v "$c" >/dev/null || missing+=("$c")
done
mkdir -p "$LOG"
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "${missing[*]} missing and apt-get is not available"
    [[ $EUID -eq 0 ]] || die "${missing[*]} missing and installing them needs root"
    # Package scripts must not start daemons: we could neither track nor stop them, and a
    # daemon holding our stdout open hangs a caller that captures it. Docker images ship this
    # policy; add it for the install only when absent.
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    echo "slurm_up: installing ${PKGS[*]} (apt log: $LOG/apt.log)"
    apt_install() {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            -o Dpkg::Use-Pty=0 -o DPkg::Lock::Timeout=120 "${PKGS[@]}" </dev/null >>"$LOG/apt.log" 2>&1
    }
    # Update the package lists only when the install fails without it (it costs time).
    if ! apt_install; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null >>"$LOG/apt.log" 2>&1 \
            || die "apt-get update failed (see $LOG/apt.log)"
        apt_install || die "apt-get install ${PKGS[*]} failed (see $LOG/apt.log)"
    fi
    if [[ -e /usr/sbin/policy-rc.d ]] && trap -p EXIT | grep -q policy-rc.d; then
        rm -f /usr/sbin/policy-rc.d
        trap - EXIT
    fi
    for c in slurmctld slurmd sbatch munged; do
        command -v "$c" >/dev/null || die "$c still missing after apt-get install (see $LOG/apt.log)"
    done
fi

# Checked before starting anything, so a refusal leaves nothing running.
for p in "$CTLD_PORT" "$SLURMD_PORT"; do
    port_busy "$p" && die "port $p is in use (set SLURM_UP_CTLD_PORT / SLURM_UP_SLURMD_PORT)"
done

# --- munge ---------------------------------------------------------------------------------
rm -f "$RUN/munged.pid"
mkdir -p "$RUN"
if munge_works; then
    echo "slurm_up: using the munged already running"
else
    [[ $EUID -eq 0 ]] || die "munged is not running and starting it needs root"
    id munge >/dev/null 2>&1 || die "user munge is missing (the munge package creates it)"
    # munged refuses directories writable by others, and /run/munge is normally made by systemd.
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        echo "slurm_up: creating /etc/munge/munge.key"
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    # --force: a munged killed earlier leaves its socket lock behind, and nothing answers on it.
    runuser -u munge -- munged --force </dev/null >>"$LOG/munged.out" 2>&1 \
        || { tails; die "munged failed to start"; }
    for _ in $(seq 50); do munge_works && break; sleep 0.2; done
    munge_works || { tails; die "munged started but does not answer"; }
    # munged daemonizes and writes its pid file; record it so slurm_down.sh stops only this one.
    pid_alive /run/munge/munged.pid munged || die "munged runs but /run/munge/munged.pid is not its pid"
    cp /run/munge/munged.pid "$RUN/munged.pid"
    echo "slurm_up: started munged (pid $(cat "$RUN/munged.pid"))"
fi

# --- slurm.conf ----------------------------------------------------------------------------
# A fresh start: no jobs or node state from an earlier cluster come back.
rm -rf "$STATE" "$SPOOL"
mkdir -p "$STATE" "$SPOOL"
: >"$LOG/slurmctld.log"
: >"$LOG/slurmd.log"
# The CPUs this machine gives us: nproc alone obeys OMP_NUM_THREADS, and under
# OMP_NUM_THREADS=1 a node of CPUs=1 leaves a 2-task job pending forever (PartitionConfig).
ncpu=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
# Half the RAM: a RealMemory above what slurmd finds would drain the node.
mem_mb=$(awk '/^MemTotal:/ {m = int($2 / 2048); print (m > 0 ? m : 1)}' /proc/meminfo)
cat >"$CONF" <<EOF
# Written by scripts/ci/slurm_up.sh: a single-node test cluster on localhost.
ClusterName=fsdplab
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job gets a BeginTime of cred_expire + 1 s (default 120 s); under 5 is refused.
AuthInfo=cred_expire=$CRED_EXPIRE
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: track processes by parentage, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
# Poll pending jobs every 2 s (defaults 60 s / 30 s), so a requeued job restarts promptly.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
# One CPU per task whatever the core/thread layout.
SelectTypeParameters=CR_CPU
# Trust this file over what slurmd detects, so a container's odd topology never drains the node.
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$ncpu RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF

# --- daemons -------------------------------------------------------------------------------
# Both daemonize and write their pid files under $RUN. Their output goes to files: a daemon
# holding our stdout would hang a caller that captures it.
start() {
    local name=$1
    shift
    "$@" </dev/null >>"$LOG/$name.out" 2>&1 \
        || { tails; "$here/slurm_down.sh" "$PREFIX" >&2 || true; die "$name failed to start"; }
    for _ in $(seq 50); do pid_alive "$RUN/$name.pid" "$name" && break; sleep 0.2; done
    pid_alive "$RUN/$name.pid" "$name" \
        || { tails; "$here/slurm_down.sh" "$PREFIX" >&2 || true; die "$name did not stay up"; }
    echo "slurm_up: started $name (pid $(cat "$RUN/$name.pid"))"
}
start slurmctld slurmctld -f "$CONF"
start slurmd slurmd -f "$CONF" -N localhost

# --- wait for the node ---------------------------------------------------------------------
state=
for _ in $(seq 120); do
    state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
    [[ $state == idle ]] && break
    sleep 0.5
done
if [[ $state != idle ]]; then
    tails
    scontrol show node localhost >&2 2>&1 || true
    "$here/slurm_down.sh" "$PREFIX" >&2 || true
    die "node localhost is '${state:-unknown}', not idle, after 60 s (logs above, in $LOG)"
fi
echo "slurm_up: node localhost idle with $ncpu CPUs; partition debug"
echo "export SLURM_CONF=$CONF"
