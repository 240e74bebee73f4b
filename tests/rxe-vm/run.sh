#!/bin/bash
# tests/rxe-vm/run.sh -- run one command inside a throw-away qemu VM that has
# real kernel RDMA: soft-RoCE (rdma_rxe) devices on veth pairs.
#
#   tests/rxe-vm/run.sh [-v] 'command string'
#
# Why a VM: build and CI machines have no RDMA NIC and their kernel has no
# RDMA subsystem (ibv_get_device_list fails with ENOSYS), but a stock Debian
# kernel ships rdma_rxe. We boot that kernel under qemu with a tiny busybox
# initramfs and share this machine's own root filesystem into it read-only
# over virtio-9p, so host-built binaries (cargo test binaries, perftest, ...)
# run unchanged against the real rdma-core userspace and kernel verbs.
#
# Steps (all idempotent; needs root and the Debian apt sources):
#   1. apt-get install whatever is missing (qemu, busybox, rdma-core, perftest...)
#   2. fetch the kernel package linux-image-amd64 points to into $RXE_VM_CACHE,
#      build an initramfs with just the modules we need (cached by content)
#   3. boot; in the guest (guest.sh): veth pairs, rxe devices, policy routing,
#      then `bash -c command` in the current directory
#   4. stream the command's output, exit with its status.
#      125 = the VM died or timed out before the command finished.
#
# Inside the guest: / is this machine's / READ-ONLY; /tmp, /run and /var/tmp
# are fresh tmpfs (the host's /tmp is NOT visible there). The VM has no network
# card: all RDMA traffic stays inside the guest.
#
# Knobs (environment):
#   RXE_VM_NET=veth|single|none  veth: RXE_VM_PAIRS veth pairs, an rxe device on
#                                each end (default); single: one pair, rxe0 on
#                                veth0 only; none: modules loaded, no devices
#   RXE_VM_PAIRS=1               pair k = veth(2k)/veth(2k+1) = rxe(2k)/rxe(2k+1)
#                                with addresses 10.199.k.1 / 10.199.k.2
#   RXE_VM_SIW=0                 soft-iWARP pairs: pair j = sveth(2j)/sveth(2j+1)
#                                = siw(2j)/siw(2j+1), 10.198.j.1 / 10.198.j.2;
#                                siw.ko is built once per kernel (see 2b below)
#   RXE_VM_MTU=1500              veth MTU (rxe active_mtu follows: 1500 -> 1024)
#   RXE_VM_RW="/dir ..."         host dirs mounted read-write at the same path
#   RXE_VM_RO="/dir ..."         host dirs mounted read-only at the same path
#                                (useful for dirs under /tmp, hidden otherwise)
#   RXE_VM_PASSENV="VAR ..."     host environment variables copied into the guest
#   RXE_VM_TIMEOUT=900           seconds before the VM is killed (-> exit 125)
#   RXE_VM_MEM=2048 RXE_VM_SMP=2 guest memory (MiB) and vCPUs
#   RXE_VM_ACCEL=auto|tcg|kvm    auto: kvm only where it really works (not on PVM
#                                hosts, where a stock kernel hangs), else tcg
#   RXE_VM_CPU=qemu64            -cpu under tcg; ~2x faster than `max`. Do not
#                                build with target-cpu=native (SIGILL risk)
#   RXE_VM_CACHE=/var/cache/rustnet-rxe-vm   kernel + initramfs cache
#   RXE_VM_KPKG=linux-image-...  pin the kernel package; RXE_VM_REFRESH=1 asks
#                                apt again what linux-image-amd64 points to
#   RXE_VM_KEEP_JOB=1            keep the per-run job folder (console.log, ...)
#   -v or RXE_VM_CONSOLE=1       show the serial console live
#
# In the guest the command sees RXE_VM_PAIRS, RXE_VM_DEVICES ("rxe0 rxe1 ..."),
# RXE_VM_IP0, RXE_VM_IP1, ... (RXE_VM_IPn = address of the netdev under rxe n),
# and with RXE_VM_SIW: RXE_VM_SIW_DEVICES ("siw0 siw1 ..."), RXE_VM_SIW_IPn.
set -u -o pipefail

HERE=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
CACHE=${RXE_VM_CACHE:-/var/cache/rustnet-rxe-vm}
CONSOLE=${RXE_VM_CONSOLE:-0}
if [ "${1:-}" = -v ]; then CONSOLE=1; shift; fi
if [ $# -lt 1 ] || [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  echo "usage: $0 [-v] 'command to run inside the rxe VM'  (knobs: see the header of $0)" >&2
  exit 2
fi
CMD="$*"
NET=${RXE_VM_NET:-veth}
PAIRS=${RXE_VM_PAIRS:-1}
MTU=${RXE_VM_MTU:-1500}
TIMEOUT=${RXE_VM_TIMEOUT:-900}
msg() { echo "[rxe-vm] $*" >&2; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

case $NET in veth|single|none) ;; *) msg "RXE_VM_NET must be veth, single or none"; exit 2 ;; esac
# pair k uses 10.199.k.0/24 and rule prefs 100+2k, 101+2k, which must stay
# below the `local` table's new pref 1000; 128 pairs (256 rxe) is plenty
if ! [[ $PAIRS =~ ^[0-9]+$ ]] || [ "$PAIRS" -lt 1 ] || [ "$PAIRS" -gt 128 ]; then
  msg "RXE_VM_PAIRS must be 1..128"; exit 2
fi
[ "$NET" = veth ] || PAIRS=1
t_start=$(date +%s.%N)

# ---- 1. host packages --------------------------------------------------------
# libibverbs-dev/librdmacm-dev are not needed by the VM itself, but whatever we
# build on the host to run in it links against them.
PKGS="qemu-system-x86 seabios busybox-static kmod cpio gzip rdma-core ibverbs-utils
      ibverbs-providers libibverbs-dev librdmacm-dev rdmacm-utils perftest iproute2 tcpdump"
# shellcheck disable=SC2086
installed=$(dpkg-query -W -f='${Package} ${db:Status-Status}\n' $PKGS 2>/dev/null | awk '$2 == "installed" { print $1 }')
missing=""
for p in $PKGS; do
  grep -qx "$p" <<<"$installed" || missing+=" $p"
done
if [ -n "$missing" ]; then
  [ "$(id -u)" = 0 ] || { msg "missing packages:$missing (run as root to install)"; exit 125; }
  msg "installing:$missing"
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $missing >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $missing >/dev/null; } ||
    { msg "apt-get install failed"; exit 125; }
fi

# ---- 2. kernel and initramfs (cached) ----------------------------------------
mkdir -p "$CACHE" || exit 125
exec 9>"$CACHE/.lock"
flock 9   # two first runs at once must not unpack into the same folder

# Which kernel: RXE_VM_KPKG, else the one we used last time (so a routine apt
# update does not silently change the kernel under CI), else ask apt.
KPKG=${RXE_VM_KPKG:-}
if [ -z "$KPKG" ] && [ "${RXE_VM_REFRESH:-0}" != 1 ] && [ -s "$CACHE/kpkg" ]; then
  KPKG=$(<"$CACHE/kpkg")
fi
if [ -z "$KPKG" ]; then
  resolve() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'; }
  KPKG=$(resolve)
  [ -n "$KPKG" ] || { apt-get update -q >/dev/null 2>&1; KPKG=$(resolve); }
  [ -n "$KPKG" ] || { msg "cannot resolve linux-image-amd64 via apt"; exit 125; }
  echo "$KPKG" > "$CACHE/kpkg"
fi
KVER=${KPKG#linux-image-}
KDIR=$CACHE/$KVER
VMLINUZ=$KDIR/root/boot/vmlinuz-$KVER
if [ ! -f "$VMLINUZ" ]; then
  msg "downloading $KPKG"
  rm -rf "$KDIR" && mkdir -p "$KDIR/deb" || exit 125
  (cd "$KDIR/deb" && apt-get download -q "$KPKG" >/dev/null 2>&1) ||
    (apt-get update -q >/dev/null 2>&1; cd "$KDIR/deb" && apt-get download -q "$KPKG" >/dev/null) ||
    { msg "apt-get download $KPKG failed"; exit 125; }
  dpkg-deb -x "$KDIR"/deb/*.deb "$KDIR/root.tmp" && depmod -b "$KDIR/root.tmp" "$KVER" &&
    mv "$KDIR/root.tmp" "$KDIR/root" || { msg "unpacking $KPKG failed"; exit 125; }
  rm -rf "$KDIR/deb"   # the unpacked tree is all we need
fi

# ---- 2b. soft-iWARP (siw.ko), built once per kernel when RXE_VM_SIW asks ----
# Debian's kernel is built without CONFIG_RDMA_SIW, but the driver is self-
# contained: build it out of tree from linux-source (only drivers/infiniband/
# sw/siw is unpacked) against linux-headers + linux-kbuild of the exact same
# package version, all fetched with `apt-get download` into a scratch folder
# (nothing is installed on the host but gcc-12 and make). The stripped module
# goes into the cached kernel tree under updates/, where depmod and
# `modprobe --show-depends` find it like any other; every later image of this
# kernel carries it, and init.sh loads it only when the kernel command line
# says rxevm.siw=1. The VM has no network, hence all of this on the host.
SIWKO=$KDIR/root/lib/modules/$KVER/updates/siw.ko
build_siw() {
  local t0 kv w h p
  t0=$(date +%s.%N)
  kv=$(apt-cache show "$KPKG" 2>/dev/null | awk '/^Version:/ { print $2; exit }')
  [ -n "$kv" ] || { msg "siw: cannot find the version of $KPKG"; return 1; }
  for p in gcc-12 make xz-utils; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed && continue
    [ "$(id -u)" = 0 ] || { msg "siw: needs package $p (run as root to install)"; return 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$p" >/dev/null || return 1
  done
  w=$(mktemp -d) || return 1
  msg "siw: building siw.ko for $KVER ($kv) in $w"
  # (no `set -e` here: it is ignored in a function called as `build_siw || ...`)
  (
    cd "$w" || exit 1
    # 6.1.0-57-amd64 -> linux-source-6.1, linux-headers-6.1.0-57-{amd64,common}, linux-kbuild-6.1
    mm=$(cut -d. -f1,2 <<<"$KVER")
    debs=("linux-source-$mm=$kv" "linux-headers-$KVER=$kv" "linux-headers-${KVER%-*}-common=$kv" "linux-kbuild-$mm=$kv")
    apt-get download -q "${debs[@]}" >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1; apt-get download -q "${debs[@]}" >/dev/null; } || exit 1
    for d in linux-headers-*.deb linux-kbuild-*.deb; do dpkg-deb -x "$d" hdr || exit 1; done
    dpkg-deb --fsys-tarfile linux-source-*.deb | tar -xO --wildcards './usr/src/linux-source-*.tar.xz' |
      tar -xJ --wildcards '*/drivers/infiniband/sw/siw' || exit 1
    mv linux-source-*/drivers/infiniband/sw/siw src || exit 1
    h=$w/hdr/usr/src
    # the arch headers' Makefile includes the common ones by absolute path
    sed -i "s|/usr/src/|$h/|" "$h/linux-headers-$KVER/Makefile" || exit 1
    make -s -C "$h/linux-headers-$KVER" M="$w/src" CONFIG_RDMA_SIW=m modules >make.log 2>&1 ||
      { cat make.log >&2; exit 1; }
    strip --strip-debug src/siw.ko && mkdir -p "${SIWKO%/*}" && cp src/siw.ko "$SIWKO.tmp"
  ) || { rm -rf "$w"; msg "siw: build failed"; return 1; }
  rm -rf "$w"
  mv "$SIWKO.tmp" "$SIWKO" && depmod -b "$KDIR/root" "$KVER" || return 1
  msg "siw: built in $(secs "$t0" "$(date +%s.%N)")s"
}
SIW=${RXE_VM_SIW:-0}
if ! [[ $SIW =~ ^[0-9]+$ ]] || [ "$SIW" -gt 16 ]; then msg "RXE_VM_SIW must be 0..16"; exit 2; fi
[ "$NET" = none ] && SIW=0
if [ "$SIW" -gt 0 ] && [ ! -f "$SIWKO" ]; then
  build_siw || exit 125
fi

# Modules the initramfs loads, in order. rdma_rxe computes ICRCs through the
# crypto API ("crc32"), which needs crc32_generic (crc32-pclmul is only a faster
# variant and needs PCLMULQDQ, which -cpu qemu64 lacks). veth/dummy/8021q give
# tests netdevs to put rxe on; rdma_ucm is rdma_cm for userspace; sch_netem
# lets scripts/soak.sh drop 1% of the packets on the veths (tc ... netem loss).
MODULES="virtio_pci 9pnet_virtio 9p crc32_generic crc32-pclmul ib_uverbs rdma_ucm rdma_rxe veth dummy 8021q sch_netem"
# The image is rebuilt whenever anything that goes into it changes.
# siw (and the crc32c it computes MPA CRCs with; crc32c-intel needs SSE4.2,
# which qemu64 lacks) go in whenever siw.ko has been built, listed apart in
# /etc/modules.siw: init.sh loads them only for rxevm.siw=1, so images need
# not be rebuilt when runs with and without siw alternate.
SIWMODS=""
[ -f "$SIWKO" ] && SIWMODS="crc32c_generic siw"
key=$( { cat "$HERE/init.sh" /bin/busybox; echo "$MODULES / $SIWMODS"; [ -f "$SIWKO" ] && cat "$SIWKO"; } | md5sum | cut -c1-16)
INITRD=$KDIR/initrd-$key.img
if [ ! -f "$INITRD" ]; then
  msg "building initramfs"
  R=$(mktemp -d) || exit 125
  M=$R/lib/modules/$KVER
  mkdir -p "$R/bin" "$R/etc" "$M"
  cp /bin/busybox "$R/bin/busybox" && cp "$HERE/init.sh" "$R/init" && chmod 755 "$R/init" || exit 125
  echo "$MODULES" > "$R/etc/modules"
  echo "$SIWMODS" > "$R/etc/modules.siw"
  for m in $MODULES $SIWMODS; do
    modprobe -d "$KDIR/root" -S "$KVER" --show-depends "$m" 2>/dev/null
  done | awk '$1 == "insmod" { print $2 }' | sort -u | while read -r f; do
    rel=${f#"$KDIR/root/lib/modules/$KVER/"}
    mkdir -p "$M/${rel%/*}" && cp "$f" "$M/$rel"
  done
  cp "$KDIR/root/lib/modules/$KVER"/modules.{builtin,builtin.modinfo,order} "$M/"
  depmod -b "$R" "$KVER" || exit 125
  (cd "$R" && find . | cpio -o -H newc --quiet | gzip -1) > "$INITRD.tmp" || exit 125
  rm -f "$KDIR"/initrd-*.img && mv "$INITRD.tmp" "$INITRD"
  rm -rf "$R"
fi
flock -u 9

# ---- 3. per-run job folder (shared read-write with the guest) ----------------
JOB=$(mktemp -d "${TMPDIR:-/tmp}/rxe-vm-job.XXXXXX") || exit 125
cp "$HERE/guest.sh" "$JOB/" || exit 125
printf '%s\n' "$CMD" > "$JOB/cmd.sh"
: > "$JOB/output.log"
{
  printf 'RXE_VM_NET=%q RXE_VM_PAIRS=%q RXE_VM_MTU=%q RXE_VM_CWD=%q RXE_VM_SIW=%q\n' "$NET" "$PAIRS" "$MTU" "$PWD" "$SIW"
  for v in ${RXE_VM_PASSENV:-}; do
    [ -n "${!v+x}" ] && printf 'export %s=%q\n' "$v" "${!v}"
  done
} > "$JOB/env.sh"

# Extra host folders: one 9p device each, mounted by guest.sh at the same path.
EXTRA=()
n=0
: > "$JOB/mounts"
add_mounts() { # add_mounts rw|ro "dir dir ..."
  local mode=$1 d ro=off
  [ "$mode" = ro ] && ro=on
  for d in $2; do
    d=$(readlink -f "$d")
    [ -d "$d" ] || { msg "RXE_VM_${mode^^}: $d is not a directory"; exit 2; }
    EXTRA+=(-fsdev "local,id=fsx$n,path=$d,security_model=none,readonly=$ro,multidevs=remap"
            -device "virtio-9p-pci,fsdev=fsx$n,mount_tag=x$n")
    echo "x$n $mode $d" >> "$JOB/mounts"
    n=$((n + 1))
  done
}
add_mounts rw "${RXE_VM_RW:-}"
add_mounts ro "${RXE_VM_RO:-}"

# ---- 4. boot -----------------------------------------------------------------
ACCEL=${RXE_VM_ACCEL:-auto}
if [ "$ACCEL" = auto ]; then
  # kvm_pvm is a nested "PVM" hypervisor: only PVM-aware guest kernels boot on
  # it, a stock Debian kernel hangs right after "Probing EDD". So only plain KVM.
  ACCEL=tcg
  if [ -w /dev/kvm ] && [ ! -d /sys/module/kvm_pvm ]; then ACCEL=kvm; fi
fi
# shellcheck disable=SC2054  # qemu takes comma-separated options in one argument
if [ "$ACCEL" = kvm ]; then CPUARGS=(-accel kvm -cpu host,-arch-capabilities)
else CPUARGS=(-accel tcg,thread=multi -cpu "${RXE_VM_CPU:-qemu64}"); fi
if [ "$CONSOLE" = 1 ]; then SERIAL=(-serial stdio); else SERIAL=(-serial "file:$JOB/console.log"); fi
SMP=${RXE_VM_SMP:-2}
MEM=${RXE_VM_MEM:-2048}
msg "booting $KVER ($ACCEL, $SMP vCPU, $MEM MiB, net=$NET pairs=$PAIRS siw pairs=$SIW)"
t_boot=$(date +%s.%N)
# Under TCG the guest finds its vCPUs' TSCs slightly apart and falls back to
# the HPET, whose every read is an emulated MMIO exit (microseconds): clock
# reads would then dominate any timing loop. The TSC is what real machines
# give a clock read (vDSO, no system call), so use it (RXE_VM_KCMD to override).
KCMD=${RXE_VM_KCMD-tsc=reliable clocksource=tsc}
[ "$SIW" -gt 0 ] && KCMD+=" rxevm.siw=1"
timeout -k 5 "$TIMEOUT" qemu-system-x86_64 "${CPUARGS[@]}" -smp "$SMP" -m "$MEM" \
  -nodefaults -no-user-config -display none -no-reboot -nic none "${SERIAL[@]}" \
  -kernel "$VMLINUZ" -initrd "$INITRD" \
  -append "console=ttyS0 panic=-1 loglevel=4 quiet $KCMD" \
  -fsdev local,id=fsroot,path=/,security_model=none,readonly=on,multidevs=remap \
  -device virtio-9p-pci,fsdev=fsroot,mount_tag=hostroot \
  -fsdev "local,id=fsjob,path=$JOB,security_model=none,multidevs=remap" \
  -device virtio-9p-pci,fsdev=fsjob,mount_tag=rxejob \
  "${EXTRA[@]}" </dev/null &
qpid=$!
stopped=0
on_signal() { stopped=1; msg "interrupted, stopping the VM"; kill "$qpid" 2>/dev/null; }
trap on_signal INT TERM HUP
# The guest writes the command's output straight into the shared job folder;
# follow it so long runs show progress instead of one dump at the end.
tail -n +1 -F --pid="$qpid" "$JOB/output.log" 2>/dev/null &
tpid=$!
wait "$qpid"; qrc=$?
while [ "$stopped" = 1 ] && kill -0 "$qpid" 2>/dev/null; do wait "$qpid"; done
wait "$tpid"
t_end=$(date +%s.%N)

# ---- 5. result ---------------------------------------------------------------
if [ -s "$JOB/rc" ]; then
  rc=$(<"$JOB/rc")
else
  rc=125
  if [ "$qrc" = 124 ]; then msg "VM killed after RXE_VM_TIMEOUT=${TIMEOUT}s"
  else msg "VM ended (qemu status $qrc) before the command finished"; fi
  if [ -f "$JOB/console.log" ]; then msg "console tail:"; tail -n 30 "$JOB/console.log" >&2; fi
  [ -s "$JOB/setup.log" ] && { msg "guest setup log:"; cat "$JOB/setup.log" >&2; }
fi
# guest.sh records guest uptimes: setup start, command start, command end
g_end=""
[ -s "$JOB/times" ] && read -r g_setup g_cmd g_end < "$JOB/times"
detail=""
[ -n "${g_end:-}" ] && detail=" (guest: boot to setup ${g_setup}s, setup $(secs "$g_setup" "$g_cmd")s, command $(secs "$g_cmd" "$g_end")s)"
msg "exit status $rc; prepare $(secs "$t_start" "$t_boot")s, VM $(secs "$t_boot" "$t_end")s$detail"
if [ "${RXE_VM_KEEP_JOB:-0}" = 1 ]; then msg "job folder kept: $JOB"; else rm -rf "$JOB"; fi
exit "$rc"
