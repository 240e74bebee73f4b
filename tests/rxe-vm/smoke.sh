#!/bin/bash
# tests/rxe-vm/smoke.sh -- sanity check of the rxe rig; runs INSIDE the VM:
#
#   tests/rxe-vm/run.sh tests/rxe-vm/smoke.sh             # rxe0 -> rxe1
#   RXE_VM_PAIRS=2 tests/rxe-vm/run.sh 'tests/rxe-vm/smoke.sh all'   # every pair
#   tests/rxe-vm/run.sh 'tests/rxe-vm/smoke.sh rxe2:rxe3'  # CLIENT:SERVER ...
#
# Prints an ibv_devinfo summary and the GID table of every rxe device, checks
# that GID index 1 is the IPv4 RoCE v2 GID (::ffff:a.b.c.d, what `-x 1` and
# most tests assume), then runs one short ib_write_bw per CLIENT:SERVER pair
# across its veth pair. Last line: "smoke: PASS" or "smoke: FAIL"; exit 0/1.
#
# Under TCG every process start costs ~0.15 s, and an rxe device has 1024 GID
# slots: everything below reads sysfs with bash's `read` builtin, never with a
# forked cat/grep per file.
fail=0
bad() { echo "FAIL: $*"; fail=1; }
t0=$EPOCHREALTIME
elapsed() { local n=$EPOCHREALTIME; printf '%.1f' "$(( (${n/./} - ${1/./}) / 1000 ))e-3"; }
IPV4_PREFIX=0000:0000:0000:0000:0000:ffff:

# 0000:0000:0000:0000:0000:ffff:0ac7:0001 -> 10.199.0.1
gid_ipv4() { local h=${1#"$IPV4_PREFIX"}; h=${h/:/}; echo "$((16#${h:0:2})).$((16#${h:2:2})).$((16#${h:4:2})).$((16#${h:6:2}))"; }

# First GID index holding an IPv4 RoCE v2 GID of device $1, in $v4idx.
v4idx=""
find_v4() {
  local p=/sys/class/infiniband/$1/ports/1 i g t
  local slots=("$p"/gids/*)
  v4idx=""
  for ((i = 0; i < ${#slots[@]}; i++)); do
    read -r g < "$p/gids/$i" || continue
    [[ $g == "$IPV4_PREFIX"* ]] || continue
    read -r t 2>/dev/null < "$p/gid_attrs/types/$i"
    [ "$t" = "RoCE v2" ] && { v4idx=$i; return 0; }
  done
  return 1
}

gid_table() {
  local d=$1 p=/sys/class/infiniband/$1/ports/1 i g t nd extra
  local slots=("$p"/gids/*)
  for ((i = 0; i < ${#slots[@]}; i++)); do
    read -r g < "$p/gids/$i" || continue
    [ "$g" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
    # empty slots fail with EINVAL here, used ones have a type and a netdev
    read -r t 2>/dev/null < "$p/gid_attrs/types/$i"
    read -r nd 2>/dev/null < "$p/gid_attrs/ndevs/$i"
    extra=""
    [[ $g == "$IPV4_PREFIX"* ]] && extra=" (IPv4 $(gid_ipv4 "$g"))"
    echo "  $d gid[$i] $g type=${t:-?} ndev=${nd:-?}$extra"
  done
  echo "  $d: ${#slots[@]} GID slots"
}

devs=()
for p in /sys/class/infiniband/*; do [ -e "$p" ] && devs+=("${p##*/}"); done
if [ ${#devs[@]} = 0 ]; then
  bad "no RDMA devices (RXE_VM_NET=none?)"
  echo "smoke: FAIL"; exit 1
fi

echo "== ibv_devinfo"
while read -r line; do
  case $line in hca_id:*|node_guid:*|state:*|active_mtu:*|link_layer:*) echo "  $line" ;; esac
done < <(ibv_devinfo)

echo "== GID tables"
for d in "${devs[@]}"; do
  # siw (RXE_VM_SIW) has one MAC-based GID and connects through rdma_cm
  case $d in siw*) echo "  $d: iWARP, addressed through rdma_cm (no RoCE GID)"; continue ;; esac
  gid_table "$d"
  if find_v4 "$d"; then
    if [ "$v4idx" = 1 ]; then echo "  $d: gid[1] is the IPv4 RoCE v2 GID -- ok for -x 1"
    else echo "  $d: NOTE: IPv4 RoCE v2 GID is at index $v4idx, not 1 (using $v4idx below)"; fi
  else
    bad "$d has no IPv4 RoCE v2 GID"
  fi
done

# Wait until something LISTENs on TCP port $1 (perftest's out-of-band socket),
# reading /proc/net/tcp{,6} with builtins: 100 polls x (1 sleep fork) max.
listening() {
  local hex f laddr st _
  printf -v hex '%04X' "$1"
  for f in /proc/net/tcp /proc/net/tcp6; do
    while read -r _ laddr _ st _; do
      [ "$st" = 0A ] && [[ $laddr == *:$hex ]] && return 0
    done < "$f"
  done
  return 1
}

# write_bw CLIENT SERVER PORT: one short ib_write_bw, client -> server.
write_bw() {
  local c=$1 s=$2 port=$3 cx sx sip ts srv crc src
  local args=(-F -s 65536 -n 100 -p "$port")
  local sargs=() cargs=()
  if [[ $s == siw* ]]; then
    # iWARP: perftest must connect with rdma_cm (-R), to the server's address
    local v=RXE_VM_SIW_IP${s#siw}
    sip=${!v:-}
    [ -n "$sip" ] || { bad "$s: no RXE_VM_SIW_IP${s#siw}"; return; }
    cx=cm sx=cm sargs=(-R -d "$s") cargs=(-R -d "$c")
  else
    find_v4 "$c" && cx=$v4idx || { bad "$c: no IPv4 GID"; return; }
    find_v4 "$s" && sx=$v4idx || { bad "$s: no IPv4 GID"; return; }
    sip=$(gid_ipv4 "$(read -r g < "/sys/class/infiniband/$s/ports/1/gids/$sx"; echo "$g")")
    sargs=(-d "$s" -x "$sx") cargs=(-d "$c" -x "$cx")
  fi
  ts=$EPOCHREALTIME
  timeout 60 ib_write_bw "${args[@]}" "${sargs[@]}" > /tmp/smoke-srv.log 2>&1 &
  srv=$!
  for ((w = 0; w < 100; w++)); do listening "$port" && break; sleep 0.1; done
  timeout 60 ib_write_bw "${args[@]}" "${cargs[@]}" "$sip" > /tmp/smoke-cli.log 2>&1
  crc=$?
  wait $srv; src=$?
  echo "== ib_write_bw 64 KiB x 100: $c (gid $cx) -> $s (gid $sx, $sip): client rc=$crc server rc=$src, $(elapsed "$ts") s"
  local line bw=""
  while read -r line; do
    # result row: #bytes #iterations BW-peak BW-average MsgRate (MiB/s, Mpps)
    [[ $line =~ ^65536[[:space:]]+100[[:space:]]+([0-9.]+)[[:space:]]+([0-9.]+) ]] && bw=${BASH_REMATCH[2]}
  done < /tmp/smoke-cli.log
  if [ "$crc" = 0 ] && [ "$src" = 0 ] && [ -n "$bw" ]; then
    echo "  average ${bw} MiB/s (emulated: a function check, not a speed)"
  else
    bad "ib_write_bw $c -> $s"
    echo "  --- client:"; tail -n 15 /tmp/smoke-cli.log
    echo "  --- server:"; tail -n 15 /tmp/smoke-srv.log
  fi
}

pairs=("$@")
if [ ${#pairs[@]} = 0 ]; then pairs=(rxe0:rxe1); fi
if [ "${pairs[0]}" = all ]; then
  pairs=()
  for ((k = 0; k < ${RXE_VM_PAIRS:-1}; k++)); do pairs+=("rxe$((2 * k)):rxe$((2 * k + 1))"); done
fi
# with siw pairs booted (RXE_VM_SIW), the default run checks siw0 -> siw1 too
if [ $# = 0 ] && [ -n "${RXE_VM_SIW_DEVICES:-}" ]; then pairs+=(siw0:siw1); fi
port=18515
for pr in "${pairs[@]}"; do
  write_bw "${pr%%:*}" "${pr##*:}" $port
  port=$((port + 1))   # a fresh port: no TIME_WAIT surprises between runs
done

echo "smoke: $([ $fail = 0 ] && echo PASS || echo FAIL) ($(elapsed "$t0") s)"
exit $fail
