#!/usr/bin/env bash
# Simulated hosts for the multihost tests: H network namespaces joined by a bridge that lives in a namespace
# of its own, each host also in its own PID, IPC, UTS and mount namespaces with a private /tmp, /dev/shm and
# /run, its own hostname (ddp-host<i>) and its own boot id, so that ddp sees separate machines. Addresses
# (10.200.<net>.<i+1>/24 on eth<net>) exist only inside these namespaces. Everything is deleted on every
# exit path (the command's end, a failure, a signal), and namespaces an earlier run left behind (its
# script killed with SIGKILL) are deleted by the next run.
#
#   multihost.sh --check                      exit 0 where hosts can be simulated; else say why, exit 77
#   multihost.sh [--hosts H] [--nets N] [--rate R] [--timeout S] [--out DIR] -- 'command'
#
# Runs `sh -c 'command'` on every host at once with MH_HOST (0..H-1), MH_HOSTS, MH_MASTER (host 0's address
# on eth0) and DDP_TOKEN (random unless set) in its environment; each output line is prefixed "[host i] "
# (with --out DIR: host i's output goes to DIR/host<i>.log, its exit status to DIR/host<i>.status and the
# time it ended, in seconds since the epoch, to DIR/host<i>.end). --rate limits each host's outgoing
# traffic on every interface (tc tbf, e.g. 1gbit); --timeout (default 60) kills every host's command after
# S seconds (status 124). Exits 0 when every host's command did, else with the first failing host's status.
set -u

hosts=2 nets=1 rate="" limit=60 out=""
prefix="ddpmh-$$"

cannot_run() {
  echo "multihost: not run: $1" >&2
  [ "${DDP_MULTIHOST_REQUIRED:-0}" = 1 ] && exit 1  # CI that must run them fails instead
  exit 77
}

check() {
  [ "$(id -u)" = 0 ] || cannot_run "simulated hosts need root (ip netns, unshare, mount); run ctest -L multihost as root"
  for tool in ip tc unshare mount hostname timeout; do
    command -v "$tool" >/dev/null 2>&1 || cannot_run "the tool '$tool' is missing (iproute2, util-linux, coreutils)"
  done
  ip netns add "$prefix-probe" 2>/dev/null || cannot_run "'ip netns add' fails here (no CAP_SYS_ADMIN, or a kernel without network namespaces)"
  local ok=1
  ip netns exec "$prefix-probe" unshare --pid --uts --ipc --mount --fork --mount-proc true 2>/dev/null || ok=0
  ip netns del "$prefix-probe"
  [ "$ok" = 1 ] || cannot_run "'unshare --pid --uts --ipc --mount --fork --mount-proc' fails inside a network namespace"
}

# Deletes the namespaces of runs whose script is gone (killed before its trap could run).
delete_stale() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^ddpmh-[0-9]*-'); do
    pid=${ns#ddpmh-}
    pid=${pid%%-*}
    kill -0 "$pid" 2>/dev/null && continue
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
}

cleanup() {
  trap - EXIT INT TERM HUP
  local ns p i
  for ((i = 0; i < hosts; i++)); do [ -n "${runner[$i]:-}" ] && kill -9 "${runner[$i]}" 2>/dev/null; done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$prefix-"); do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
  [ -n "${scratch:-}" ] && rm -rf "$scratch"
}

# What runs as pid 1 of a host: private /tmp, /dev/shm and /run, a hostname, a boot id, then the command. The
# folders of /tmp named in MH_KEEP (a source or build tree there, which every host shares) are bound back in.
host_init='
mount --make-rprivate / &&
mount -t tmpfs -o mode=755 tmpfs /run && mkdir /run/shared-tmp && mount --rbind /tmp /run/shared-tmp &&
mount -t tmpfs -o mode=1777 tmpfs /tmp && mount -t tmpfs -o mode=1777 tmpfs /dev/shm &&
for kept in $MH_KEEP; do mkdir -p "/tmp/$kept" && mount --rbind "/run/shared-tmp/$kept" "/tmp/$kept" || exit 125; done &&
hostname "ddp-host$MH_HOST" &&
cat /proc/sys/kernel/random/uuid > /run/boot_id && mount --bind /run/boot_id /proc/sys/kernel/random/boot_id ||
{ echo "multihost: setting up host $MH_HOST failed" >&2; exit 125; }
exec sh -c "$1"'

command=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check) check; exit 0 ;;
    --hosts) hosts=$2; shift 2 ;;
    --nets) nets=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --) shift; command="$*"; break ;;
    *) echo "multihost.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ -n "$command" ] || { echo "multihost.sh: the command is missing; pass it after --" >&2; exit 2; }
[[ "$hosts" =~ ^[1-9][0-9]?$ && "$nets" =~ ^[1-4]$ && "$limit" =~ ^[0-9]+$ ]] ||
  { echo "multihost.sh: --hosts takes 1..99, --nets 1..4, --timeout whole seconds" >&2; exit 2; }

check
declare -a runner
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
delete_stale
scratch=$(mktemp -d)
[ -n "$out" ] || out=$scratch
mkdir -p "$out"

sw="$prefix-sw"
ip netns add "$sw" || exit 1
ip -n "$sw" link set lo up
for ((n = 0; n < nets; n++)); do
  ip -n "$sw" link add "br$n" type bridge && ip -n "$sw" link set "br$n" up || exit 1
done
for ((i = 0; i < hosts; i++)); do
  ns="$prefix-h$i"
  ip netns add "$ns" || exit 1
  ip -n "$ns" link set lo up
  for ((n = 0; n < nets; n++)); do
    ip link add "eth$n" netns "$ns" type veth peer name "h${i}n$n" netns "$sw" || exit 1
    ip -n "$sw" link set "h${i}n$n" master "br$n" up || exit 1
    ip -n "$ns" addr add "10.200.$n.$((i + 1))/24" dev "eth$n" && ip -n "$ns" link set "eth$n" up || exit 1
    if [ -n "$rate" ]; then
      ip netns exec "$ns" tc qdisc add dev "eth$n" root tbf rate "$rate" burst 256kb latency 50ms || exit 1
    fi
  done
done

export MH_HOSTS=$hosts MH_MASTER=10.200.0.1
# The first folder below /tmp of this script's tree and of the working directory, where they lie in /tmp.
MH_KEEP=""
for path in "$(cd "$(dirname "$0")/../.." && pwd -P)" "$(pwd -P)"; do
  case "$path" in /tmp/?*) top=${path#/tmp/}; top=${top%%/*}; case " $MH_KEEP " in *" $top "*) ;; *) MH_KEEP="$MH_KEEP $top" ;; esac ;; esac
done
export MH_KEEP
[ -n "${DDP_TOKEN:-}" ] || export DDP_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
for ((i = 0; i < hosts; i++)); do
  (
    export MH_HOST=$i
    timeout -k 2 "$limit" ip netns exec "$prefix-h$i" \
      unshare --pid --uts --ipc --mount --fork --mount-proc sh -c "$host_init" host-init "$command" \
      >"$out/host$i.log" 2>&1
    echo $? >"$out/host$i.status"
    date +%s.%N >"$out/host$i.end"
  ) &
  runner[$i]=$!
done
status=0
for ((i = 0; i < hosts; i++)); do
  wait "${runner[$i]}"
  runner[$i]=""
done
for ((i = 0; i < hosts; i++)); do
  s=$(cat "$out/host$i.status" 2>/dev/null || echo 125)
  [ "$out" = "$scratch" ] && sed "s/^/[host $i] /" "$out/host$i.log"
  if [ "$s" != 0 ]; then
    echo "multihost: host $i exited with status $s" >&2
    [ "$status" = 0 ] && status=$s
  fi
done
exit "$status"
