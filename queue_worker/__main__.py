"""``python -m chunkq.queue_worker``: the pool ``chunkq run`` starts (queue_worker.processes.pool.main)."""

import sys

from chunkq.queue_worker.processes.pool import main

sys.exit(main())
