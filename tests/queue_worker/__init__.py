"""Tests of workers, pools, fork servers and devices (queue_worker/)."""
