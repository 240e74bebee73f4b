#!/bin/bash
# tests/rxe-vm/guest.sh -- runs INSIDE the VM (started by init.sh), chrooted
# into the host's root: / is the host's / read-only, /tmp /run /var/tmp are
# tmpfs, /tmp/rxe-job is the host's per-run job folder (read-write).
#
# Brings up the veth pairs and rxe devices, runs the user's command from
# cmd.sh, records its output (output.log), status (rc) and guest uptimes
# (times) in the job folder.
#
# Every process start costs ~0.15 s under TCG (exec + libraries over 9p), so
# this script is fork-light on purpose: sysctls are written with echo, sysfs
# is read with `read`, and ip/rdma get all their commands in one batch each.
J=/tmp/rxe-job
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/tmp TERM=dumb LANG=C.UTF-8
cd /tmp || exit 1
: > $J/setup.log
uptime() { local u _; read -r u _ < /proc/uptime; echo "$u"; }
log() { echo "rxe-vm: $*" | tee -a $J/setup.log; }
t_setup=$(uptime)
# shellcheck disable=SC1091
. $J/env.sh
export RXE_VM_NET RXE_VM_PAIRS RXE_VM_MTU RXE_VM_SIW

# Extra host folders (RXE_VM_RW / RXE_VM_RO). The mount point may have to be
# created first: paths under /tmp live on the guest's fresh tmpfs.
while read -r tag mode dir; do
  [ -n "$tag" ] || continue
  [ -d "$dir" ] || mkdir -p "$dir" 2>/dev/null
  mount -t 9p -o "trans=virtio,version=9p2000.L,msize=262144,$mode,cache=none" "$tag" "$dir" ||
    log "WARNING: cannot mount $dir ($mode)"
done < $J/mounts

# ---- network + rxe -----------------------------------------------------------
# Pair k: veth(2k) 10.199.k.1 <-> veth(2k+1) 10.199.k.2, rxe(2k) on veth(2k),
# rxe(2k+1) on veth(2k+1). RXE_VM_IPn is the address under rxe n.
#
# Routing: both ends of every pair live in this one namespace, so both
# addresses are local and the kernel would deliver 10.199.k.1 -> 10.199.k.2
# through lo -- and rxe drops RoCE packets that arrive on a netdev without an
# rxe device (lo has none). So locally generated traffic to each address is
# sent out of the *other* end of its pair by policy rules that are consulted
# before the `local` table (moved from pref 0 to 1000). Packets then arrive on
# the right veth, where `local` delivers them (accept_local allows a local
# source address, rp_filter off because the reverse path is asymmetric).
ipcmds="" rdmacmds="" devices="" siwdevs="" vethnames=""
ip link set lo up
if [ "$RXE_VM_NET" != none ]; then
  for ((k = 0; k < RXE_VM_PAIRS; k++)); do
    a=veth$((2 * k)) b=veth$((2 * k + 1))
    ipa=10.199.$k.1 ipb=10.199.$k.2
    ta=$((100 + 2 * k)) tb=$((101 + 2 * k))
    ipcmds+="link add $a type veth peer name $b
link set dev $a mtu $RXE_VM_MTU up
link set dev $b mtu $RXE_VM_MTU up
addr add $ipa/24 dev $a
addr add $ipb/24 dev $b
route add $ipb dev $a src $ipa table $ta
route add $ipa dev $b src $ipb table $tb
rule add pref $ta iif lo to $ipb lookup $ta
rule add pref $tb iif lo to $ipa lookup $tb
"
    export "RXE_VM_IP$((2 * k))=$ipa" "RXE_VM_IP$((2 * k + 1))=$ipb"
    rdmacmds+="link add rxe$((2 * k)) type rxe netdev $a
"
    devices+=" rxe$((2 * k))"
    if [ "$RXE_VM_NET" = veth ]; then
      rdmacmds+="link add rxe$((2 * k + 1)) type rxe netdev $b
"
      devices+=" rxe$((2 * k + 1))"
    fi
  done
  # soft-iWARP pairs (RXE_VM_SIW=n): siw needs netdevs of its own -- on a
  # netdev that also carries rxe, rdma_cm binds to whichever RDMA device
  # registered first. Pair j: sveth(2j) 10.198.j.1 <-> sveth(2j+1) 10.198.j.2
  # with siw(2j)/siw(2j+1), routed like the rxe pairs (tables 600+2j, 601+2j).
  for ((j = 0; j < ${RXE_VM_SIW:-0}; j++)); do
    a=sveth$((2 * j)) b=sveth$((2 * j + 1))
    ipa=10.198.$j.1 ipb=10.198.$j.2
    ta=$((600 + 2 * j)) tb=$((601 + 2 * j))
    ipcmds+="link add $a type veth peer name $b
link set dev $a mtu $RXE_VM_MTU up
link set dev $b mtu $RXE_VM_MTU up
addr add $ipa/24 dev $a
addr add $ipb/24 dev $b
route add $ipb dev $a src $ipa table $ta
route add $ipa dev $b src $ipb table $tb
rule add pref $ta iif lo to $ipb lookup $ta
rule add pref $tb iif lo to $ipa lookup $tb
"
    export "RXE_VM_SIW_IP$((2 * j))=$ipa" "RXE_VM_SIW_IP$((2 * j + 1))=$ipb"
    rdmacmds+="link add siw$((2 * j)) type siw netdev $a
link add siw$((2 * j + 1)) type siw netdev $b
"
    siwdevs+=" siw$((2 * j)) siw$((2 * j + 1))"
    vethnames+=" $a $b"
  done
  ipcmds+="rule add pref 1000 lookup local
rule del pref 0 lookup local
"
  ip -batch - <<<"$ipcmds" 2>&1 | tee -a $J/setup.log
  echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter
  for ((i = 0; i < 2 * RXE_VM_PAIRS; i++)); do vethnames+=" veth$i"; done
  for v in $vethnames; do
    echo 1 > /proc/sys/net/ipv4/conf/$v/accept_local
    echo 0 > /proc/sys/net/ipv4/conf/$v/rp_filter
  done
  rdma -b - <<<"$rdmacmds" 2>&1 | tee -a $J/setup.log
fi
devices=${devices# } siwdevs=${siwdevs# }
export RXE_VM_DEVICES=$devices RXE_VM_SIW_DEVICES=$siwdevs

# rxe fills its GID table asynchronously after `rdma link add`; tests that
# look up the IPv4 (::ffff:a.b.c.d) RoCE v2 GID right away would miss it.
# Wait (max ~10 s) until every device is ACTIVE and has one in its first slots.
ready() { # ready rxeN
  local p=/sys/class/infiniband/$1/ports/1 s g i
  read -r s 2>/dev/null < "$p/state" || return 1
  [[ $s == *ACTIVE* ]] || return 1
  for ((i = 0; i < 8; i++)); do
    read -r g 2>/dev/null < "$p/gids/$i" || return 1
    [[ $g == 0000:0000:0000:0000:0000:ffff:* ]] && return 0
  done
  return 1
}
for d in $devices; do
  for ((w = 0; w < 100; w++)); do ready "$d" && break; sleep 0.1; done
  ready "$d" || log "WARNING: $d not ACTIVE with an IPv4 GID after 10 s"
done
# siw has one GID (from the MAC) and addresses through rdma_cm: ACTIVE is all
active() { local s; read -r s 2>/dev/null < "/sys/class/infiniband/$1/ports/1/state" && [[ $s == *ACTIVE* ]]; }
for d in $siwdevs; do
  for ((w = 0; w < 100; w++)); do active "$d" && break; sleep 0.1; done
  active "$d" || log "WARNING: $d not ACTIVE after 10 s"
done
[ -n "$siwdevs" ] && devices+=" (siw: $siwdevs)"
log "devices: ${devices:-none}; setup took $(awk -v a="$t_setup" -v b="$(uptime)" 'BEGIN{printf "%.1f", b-a}')s"

# ---- the command -------------------------------------------------------------
# Root in the VM; lift the locked-memory limit anyway so MR registration never
# depends on CAP_IPC_LOCK semantics.
ulimit -l unlimited
cd "$RXE_VM_CWD" 2>/dev/null || { log "WARNING: $RXE_VM_CWD is not visible in the guest, running in /tmp"; cd /tmp || exit 1; }
t_cmd=$(uptime)
bash $J/cmd.sh > $J/output.log 2>&1 < /dev/null
rc=$?
t_end=$(uptime)
echo "$t_setup $t_cmd $t_end" > $J/times
echo $rc > $J/rc
cd /
while read -r tag mode dir; do [ -n "$tag" ] && umount "$dir"; done < $J/mounts
exit 0
