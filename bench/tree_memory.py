"""The memory a process tree holds at its peak, sampled as it runs (bench/whole.py, bench/gpu.py)."""

from __future__ import annotations

import threading

import psutil


def _pss(pid: int) -> int:
    """A process's PSS from /proc/PID/smaps_rollup: psutil's memory_full_info parses every mapping
    of smaps, which for a 4.6 GiB plain script at 10^6 rows took half a core from the runs timed."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            for line in fh:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeMemory:
    """The peak of a process tree's summed PSS (bytes), sampled every 0.25 s in a thread; and the
    largest PSS one process of it had (what one more worker costs the host). ``also``: the roots of
    other trees that work for it (a standing fork server, whose children are the run's workers)."""

    def __init__(self, pid: int, *also: int) -> None:
        self.roots, self.peak, self.largest = [psutil.Process(p) for p in (pid, *also)], 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            procs = []
            for root in self.roots:
                try:
                    procs += [root, *root.children(recursive=True)]
                except psutil.Error:
                    continue
            each = [_pss(proc.pid) for proc in procs]
            self.peak, self.largest = max(self.peak, sum(each)), max(self.largest, *each)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak
