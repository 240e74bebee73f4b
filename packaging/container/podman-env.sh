# shellcheck shell=bash disable=SC2034  # sourced; PODMAN_RUN_OPTS is read by the sourcing script
# Sourced: sets $PODMAN to podman with this project's own storage (vfs, under
# /var/cache/rustnet-ci unless RUSTNET_PODMAN_ROOT says otherwise) and, once a
# run has been tried, $PODMAN_RUN_OPTS to the options that let containers run
# on this machine (see podman_can_run).
PODMAN_ROOT=${RUSTNET_PODMAN_ROOT:-/var/cache/rustnet-ci/containers}
PODMAN="podman --root $PODMAN_ROOT/storage --runroot /run/rustnet-ci-podman --storage-driver vfs"
PODMAN_RUN_OPTS=""
PODMAN_RUN_WHY=""
# Tries to start a container from image $1 (RUSTNET_PKG_NO_CONTAINERS=1: don't); sets PODMAN (runtime options)
# and PODMAN_RUN_OPTS on success, PODMAN_RUN_WHY (the errors) on failure.
#  - crun refuses hybrid cgroup v1/v2 hierarchies ("cgroups in hybrid mode not
#    supported"); runc with the cgroupfs manager accepts them.
#  - without CAP_SYS_RESOURCE, podman's default rlimits (nofile/nproc above
#    the caller's) fail with "setrlimit ... Operation not permitted"; the
#    limits are set to at most the caller's own.
podman_can_run() {
  local img=$1 nf np rt out
  nf=$(ulimit -Sn); [ "$nf" = unlimited ] || [ "$nf" -gt 4096 ] && nf=4096
  np=$(ulimit -Su); [ "$np" = unlimited ] || [ "$np" -gt 4096 ] && np=4096
  local lim="--ulimit nofile=$nf:$nf --ulimit nproc=$np:$np"
  PODMAN_RUN_WHY=""
  if [ "${RUSTNET_PKG_NO_CONTAINERS:-0}" = 1 ]; then PODMAN_RUN_WHY="RUSTNET_PKG_NO_CONTAINERS=1"; return 1; fi
  for rt in "" "--runtime runc --cgroup-manager cgroupfs"; do
    if [ -n "$rt" ] && ! command -v runc >/dev/null; then
      PODMAN_RUN_WHY="$PODMAN_RUN_WHY; runc not installed"; continue
    fi
    if out=$($PODMAN $rt run --rm --network none $lim "$img" /bin/true 2>&1); then
      PODMAN="$PODMAN $rt"; PODMAN_RUN_OPTS="--network none $lim"; return 0
    fi
    PODMAN_RUN_WHY="$PODMAN_RUN_WHY; ${rt:-default runtime}: $(echo "$out" | tail -n 1)"
  done
  PODMAN_RUN_WHY=${PODMAN_RUN_WHY#; }
  return 1
}
