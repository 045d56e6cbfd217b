"""``python -m chunkq.queue_worker``: the pool ``chunkq run`` starts (queue_worker.pool.main)."""

import sys

from chunkq.queue_worker.pool import main

sys.exit(main())
