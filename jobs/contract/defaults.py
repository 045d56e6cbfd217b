"""Every default a user meets, named once: the layer every other imports, so the pool's settings
(``settings.py``), a run's options (``supervisor/run_options.py``), the chunk spec and the CLI
read the same value. A default is changed here and in docs/settings.md, nowhere else.
"""

from __future__ import annotations

# Where work goes and lives.
DEFAULT_QUEUE = "chunkq"
DEFAULT_PRIORITY = 1  # a run's share of shared workers: its queue is looked in this often a round
DEFAULT_STORE = "chunkq-store"
DEFAULT_CHUNK_SIZE = 1000  # texts per chunk job
DEFAULT_WINDOW = 1000  # jobs of a run in Redis at once: ~1.5 MB, and work for 250 workers
WINDOW_PER_WORKER = 4  # with more workers than DEFAULT_WINDOW / 4 listening, the window grows with them
DEFAULT_SHARD_BYTES = 1 << 30  # 1 GiB of embeddings a shard; a result up to this size is one .npy

# How a corpus is read.
DEFAULT_TEXT_FIELD = "text"
DEFAULT_ID_FIELD = "id"

# How a chunk is encoded.
DEFAULT_OUTPUT_DTYPE = "float32"
DEFAULT_PRECISION = "fp32"
DEFAULT_BACKEND = "torch"  # the runtime a model runs on: sentence-transformers on PyTorch
DEFAULT_KIND = "dense"  # what every run was before kinds (jobs.kinds)
DEFAULT_BATCH_SIZE = 32  # sentence-transformers' own
DEFAULT_OVERLAP_SHARE = 4  # a quarter of a window overlaps the next

# Workers.
# A recycle costs a young process's slower first chunk and the hand-over: about 0.5-0.7 s on an H100,
# so 600 s of work keeps it near 0.1 %. A broken CUDA context does not wait for it: a fatal error
# exits at once.
DEFAULT_RECYCLE_AFTER = 600.0
HUNG_GRACE_SECONDS = 30.0  # past the job timeout, before a busy worker is taken for hung

# Retries of a failed chunk.
DEFAULT_MAX_ATTEMPTS = 3
BACKOFF_BASE_SECONDS = 2.0  # before the second attempt; doubles each time
BACKOFF_CAP_SECONDS = 120.0
BACKOFF_JITTER = 0.25  # +-25 %, so chunks that failed together do not return together

# Watching a run.
DEFAULT_POLL_SECONDS = 1.0  # between looks at a run; a finished chunk wakes the supervisor sooner
REDIS_PATIENCE_SECONDS = 300.0  # how long Redis may stay away before the supervisor gives up
# A command Redis has not answered in this long fails as a timeout, which each process rides out as
# it rides out Redis down. A Redis that stops answering (paused, its host cut off: the connection
# stays open) otherwise held a process in one read for as long as the installed redis-py allowed:
# no limit before redis-py 6, RQ's 415 s in a worker. (redis-py 8's own default is 5 s.)
REDIS_REPLY_SECONDS = 5.0
WARN_IDLE_SECONDS = 30.0  # a worker that lives takes a queued chunk within its model load
HEARTBEAT_SECONDS = 5.0  # a worker's beat while its chunk runs
# A running chunk whose worker has not beaten for this long is taken for stuck (a frozen or vanished
# host): failed as abandoned and retried. Two beats are the least it may be (one may come late).
STALE_AFTER_SECONDS = 60.0
STALE_AFTER_LOWEST = 2 * HEARTBEAT_SECONDS

DASHBOARD_PORT = 9181  # rq-dashboard's own
