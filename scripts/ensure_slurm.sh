#!/usr/bin/env bash
# Prints the folder holding the Slurm and MUNGE daemons (slurmctld, slurmd, munged), installing Debian's
# `slurm-wlm` and `munge` packages when they are missing (tests/helpers/slurm_cluster.py runs a one-node Slurm on
# 127.0.0.1 from them). Needs root, or sudo without a password, for apt-get; every step has a time limit,
# so a test set-up calling this can never hang.
#   usage: scripts/ensure_slurm.sh
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
NEEDED=(slurmctld slurmd munged sbatch squeue scancel sinfo scontrol)
find_slurm() {
  for name in "${NEEDED[@]}"; do command -v "$name" >/dev/null 2>&1 || return 1; done
  dirname "$(command -v slurmctld)"
}
find_slurm && exit 0
if [ "$(id -u)" = 0 ]; then sudo=(); elif sudo -n true 2>/dev/null; then sudo=(sudo -n); else
  echo "no Slurm found and no root to install it: run 'apt-get install -y slurm-wlm munge' as root" >&2; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
timeout 300 "${sudo[@]}" apt-get update -q </dev/null >&2 \
  || { echo "apt-get update failed or timed out (no package index for slurm-wlm/munge)" >&2; exit 1; }
timeout 480 "${sudo[@]}" apt-get install -y -q --no-install-recommends slurm-wlm munge </dev/null >&2 \
  || { echo "apt-get install -y slurm-wlm munge failed or timed out" >&2; exit 1; }
find_slurm || { echo "apt-get installed slurm-wlm and munge but one of ${NEEDED[*]} is not on PATH" >&2; exit 1; }
