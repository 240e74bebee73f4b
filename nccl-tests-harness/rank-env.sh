#!/bin/sh
# Per-rank environment for several MPI ranks sharing one GPU, then exec the
# command. run_nccl_tests.py puts this between mpirun and the nccl-tests
# binary: NCCL_HOSTID differs per rank, so NCCL treats every rank as its own
# host (no "same GPU" refusal, no intra-node path, all traffic over the net).
r=${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${PMI_RANK:-${SLURM_PROCID:-}}}}
if [ -z "$r" ]; then
  echo "rank-env.sh: no MPI rank in the environment (OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK, SLURM_PROCID)" >&2
  exit 2
fi
NCCL_HOSTID="${RUSTNET_HARNESS_HOSTID_PREFIX:-rustnet-harness-rank}$r"
export NCCL_HOSTID
exec "$@"
