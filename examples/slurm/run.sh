#!/bin/bash
# Submit a chunkq run to Slurm: one supervisor job (serves Redis unless CHUNKQ_REDIS_URL is set,
# splits the corpus, watches the run, assembles the result, then releases the pools) and an array
# of pool jobs, one per GPU allocation.
#
#   examples/slurm/run.sh [POOLS] [extra sbatch options for both jobs, e.g. --partition=gpu]
#
# Settings: CHUNKQ_SLURM_ENV (default: chunkq.env beside this script).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CHUNKQ_SLURM_DIR="$here"
export CHUNKQ_SLURM_ENV="${CHUNKQ_SLURM_ENV:-$here/chunkq.env}"
# shellcheck source=common.sh
source "$here/common.sh"
chunkq_load_settings
pools="${1:-4}"
shift || true

supervisor=$(sbatch --parsable --job-name="chunkq-supervisor-${CHUNKQ_RUN_ID}" "$@" "$here/supervisor.sbatch")
# The pools start once the supervisor has started (it serves Redis); more can be added any time
# with the same command, and each leaves on its own drain.
# shellcheck disable=SC2086 # CHUNKQ_POOL_RESOURCES holds sbatch options, split as written
pool=$(sbatch --parsable --array="0-$((pools - 1))" --job-name="$(chunkq_pool_job_name)" \
    --dependency="after:${supervisor}" $CHUNKQ_POOL_RESOURCES "$@" "$here/pool.sbatch")
echo "run ${CHUNKQ_RUN_ID}: supervisor job ${supervisor}, pool array ${pool} (${pools} pools)"
