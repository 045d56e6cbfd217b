"""The pool's restart policy, asked directly: a pure function of an exit code and recent history."""

from __future__ import annotations

import signal

from chunkq.queue_worker import exit_codes
from chunkq.queue_worker.processes.restart import REDIS_BACKOFF_CAP, RestartPolicy

POLICY = RestartPolicy(restart_delay=1.0, crash_limit=3, crash_window=60.0)


def test_workers_that_keep_losing_redis_are_restarted_ever_more_slowly() -> None:
    """A Redis outage must not become a respawn every second (130 workers in five minutes, seen)."""
    policy = POLICY
    losses, delays = 0, []
    for _ in range(8):
        verdict = policy.judge(exit_codes.EXIT_REDIS, losses)
        losses = verdict.redis_losses
        delays.append(verdict.delay)
        assert not verdict.counts_as_crash and verdict.may_restart and verdict.abandon_job
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, REDIS_BACKOFF_CAP, REDIS_BACKOFF_CAP, REDIS_BACKOFF_CAP]
    recycled = policy.judge(exit_codes.EXIT_MAX_JOBS, losses)  # it worked: Redis is back
    assert (recycled.delay, recycled.redis_losses, recycled.abandon_job) == (0.0, 0, False)
    assert policy.judge(exit_codes.EXIT_REDIS, recycled.redis_losses).delay == 2.0
    config = policy.judge(exit_codes.EXIT_CONFIG, 0)
    assert not config.may_restart and not config.counts_as_crash
    killed = policy.judge(-9, 0)
    assert killed.counts_as_crash and killed.abandon_job and killed.delay == 1.0


def test_a_device_is_retired_after_crash_limit_deaths_within_the_window() -> None:
    crashes: tuple[float, ...] = ()
    retired = []
    for now in (0.0, 10.0, 100.0, 110.0, 150.0):  # the first two fall out of the window by 100
        verdict = POLICY.judge(exit_codes.EXIT_CUDA_FATAL, 0, crashes, now)
        crashes = verdict.crashes
        retired.append(verdict.retire_device)
    assert retired == [False, False, False, False, True]
    assert crashes == (100.0, 110.0, 150.0)
    recycled = POLICY.judge(exit_codes.EXIT_MAX_JOBS, 0, crashes, 155.0)
    assert not recycled.retire_device and recycled.crashes == crashes  # a clean end is no crash


def test_a_sigterm_while_the_pool_stops_is_a_stop_and_otherwise_a_crash() -> None:
    stopped = POLICY.judge(-signal.SIGTERM, stopping=True)
    assert stopped.code == exit_codes.EXIT_STOPPED
    assert not stopped.abandon_job and not stopped.counts_as_crash and stopped.delay == 0.0
    killed = POLICY.judge(-signal.SIGTERM, stopping=False)
    assert killed.abandon_job and killed.counts_as_crash and killed.delay == 1.0


def test_a_forked_worker_without_cuda_stops_the_forking_not_the_device() -> None:
    verdict = POLICY.judge(exit_codes.EXIT_FORKED_NO_CUDA, 0, (1.0, 2.0), 3.0)
    assert verdict.stop_forking and verdict.may_restart
    assert not verdict.counts_as_crash and not verdict.retire_device
    assert not POLICY.judge(exit_codes.EXIT_CUDA_FATAL).stop_forking


def test_the_allocators_oom_a_gpu_that_cannot_run_the_model_and_a_context_that_will_not_open() -> None:
    """Issue 31: a GPU without kernels for the model is retired at once; a context out of memory is
    that worker's end. (The allocator's NVML assert ends no process since issue 44: it is backed
    off in the process, jobs/embed.py.)"""
    unsupported = POLICY.judge(exit_codes.EXIT_DEVICE_UNSUPPORTED, 0, (), 3.0)
    assert unsupported.retire_device and not unsupported.may_restart and not unsupported.counts_as_crash
    no_context = POLICY.judge(exit_codes.EXIT_NO_CONTEXT, 0, (1.0, 2.0), 3.0)
    assert no_context.counts_as_crash and no_context.retire_device and not no_context.stop_forking


def test_a_workers_command_line_round_trips_and_zero_recycle_after_means_never() -> None:
    """What the pool writes (worker_argv) is what the worker reads (its parser, from the same schema)."""
    from chunkq.jobs.contract.settings import PoolSettings
    from chunkq.queue_worker.worker import _parse
    from chunkq.queue_worker.worker_args import worker_argv

    settings = PoolSettings(queue="q", max_jobs=7, recycle_after=0.0, store="s", allowed_models=("a", "b"))
    args = _parse(["--name", "w", *worker_argv(settings)])
    assert (args.queue, args.max_jobs, args.store, args.allowed_models) == ("q", 7, "s", ["a", "b"])
    assert args.recycle_after is None  # 0: never by time
    assert _parse(["--recycle-after", "2.5"]).recycle_after == 2.5
    by_hand = _parse([])  # no pool: no count and no time unless told
    assert by_hand.max_jobs is None and by_hand.recycle_after is None
