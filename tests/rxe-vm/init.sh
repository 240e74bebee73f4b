#!/bin/busybox sh
# shellcheck shell=dash
# /init of the rxe-vm initramfs (busybox only; built by run.sh).
#
# Loads the modules listed in /etc/modules, mounts the host's root filesystem
# (9p tag "hostroot") read-only, puts fresh tmpfs on /tmp /run /var/tmp (a
# read-only /tmp breaks too many programs), mounts the per-run job folder (tag
# "rxejob") read-write at /tmp/rxe-job, then chroots into the host root and
# runs guest.sh from the job folder. Powers off when that returns, so qemu
# exits (-no-reboot).
/bin/busybox mkdir -p /proc /sys /dev /sbin /usr/bin /usr/sbin /newroot
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

say() { echo "rxe-vm init: $* (uptime $(cut -d' ' -f1 /proc/uptime)s)"; }
die() { say "FATAL: $*"; sleep 1; poweroff -f; }
say "started"

for m in $(cat /etc/modules); do
  case $m in
    crc32-pclmul) modprobe "$m" 2>/dev/null ;;   # optional, needs PCLMULQDQ
    dummy) modprobe dummy numdummies=0 ;;        # tests create their own
    *) modprobe "$m" || say "modprobe $m failed" ;;
  esac
done

# soft-iWARP only when run.sh asks (RXE_VM_SIW): it is out of tree (taints
# the kernel) and most runs do not want it.
case " $(cat /proc/cmdline) " in
  *" rxevm.siw=1 "*)
    for m in $(cat /etc/modules.siw 2>/dev/null); do modprobe "$m" || say "modprobe $m failed"; done ;;
esac

# cache=loose: the host root does not change under a test run, and caching
# saves a lot of 9p round trips (every exec, every shared library).
OPTS=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o $OPTS,ro,cache=loose hostroot /newroot || die "cannot mount the host root"
for d in tmp run var/tmp; do
  mount -t tmpfs -o mode=1777 tmpfs /newroot/$d || die "cannot mount tmpfs on /$d"
done
chmod 755 /newroot/run
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
# what udev would normally add: bash process substitution needs /dev/fd
ln -s /proc/self/fd /newroot/dev/fd
ln -s /proc/self/fd/0 /newroot/dev/stdin
ln -s /proc/self/fd/1 /newroot/dev/stdout
ln -s /proc/self/fd/2 /newroot/dev/stderr
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mkdir -p /newroot/tmp/rxe-job
# cache=none: output.log and rc must reach the host as they are written
mount -t 9p -o $OPTS,rw,cache=none rxejob /newroot/tmp/rxe-job || die "cannot mount the job folder"

say "root mounted"
chroot /newroot /bin/bash /tmp/rxe-job/guest.sh
say "guest.sh exited $?"
sync
umount /newroot/tmp/rxe-job 2>/dev/null
poweroff -f
