# Shell functions the recipe's jobs share (sourced, not run).

chunkq_load_settings() {
    # shellcheck disable=SC1090
    source "${CHUNKQ_SLURM_ENV:?run.sh sets CHUNKQ_SLURM_ENV: the chunkq.env every job reads}"
    if [ -n "${CHUNKQ_VENV:-}" ]; then
        # shellcheck disable=SC1091
        source "${CHUNKQ_VENV}/bin/activate"
    fi
    # A batch job starts with the cluster's login environment, not the submitting shell's.
    command -v chunkq >/dev/null || {
        echo "chunkq: not on PATH in this job on $(hostname); set CHUNKQ_VENV in chunkq.env to the" \
            "environment it is installed in (a path every node mounts)" >&2
        return 1
    }
}

chunkq_pool_job_name() {
    echo "chunkq-pool-${CHUNKQ_RUN_ID}"
}

# Wait until the store's Redis is served (its URL file appears), at most CHUNKQ_REDIS_WAIT seconds.
# chunkq itself checks that the server that wrote the file is alive before using it.
chunkq_wait_for_served_redis() {
    local url_file="${CHUNKQ_STORE}/redis/url" waited=0
    until [ -s "$url_file" ]; do
        if [ "$waited" -ge "$CHUNKQ_REDIS_WAIT" ]; then
            echo "chunkq: no Redis served in ${CHUNKQ_STORE} after ${waited} s (is the supervisor job running?)" >&2
            return 1
        fi
        sleep 5
        waited=$((waited + 5))
    done
}

# Cancel the run's pool jobs and wait (at most CHUNKQ_POOL_STOP_WAIT seconds) until they have left.
chunkq_release_pools() {
    local name user waited=0
    name="$(chunkq_pool_job_name)"
    user="$(id -un)"
    scancel --name="$name" --user="$user" || return 0
    while [ -n "$(squeue --noheader --name="$name" --user="$user" --format=%i)" ]; do
        [ "$waited" -lt "${CHUNKQ_POOL_STOP_WAIT:-120}" ] || return 0
        sleep 2
        waited=$((waited + 2))
    done
}
