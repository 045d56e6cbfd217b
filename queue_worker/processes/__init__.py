"""The pool and the processes it keeps: its loop (``pool``) and restart policy (``restart``), the
fork server its workers are forked from (``fork_server``, ``fork_client``, ``standing_forks``), a
standby that loads while its predecessor works (``standby``), each child's lifeline to its parent
(``lifeline``), how a child is stopped (``stopping``), the jobs of workers that died or hung
(``dead_workers``) and the pool's metrics (``metrics``).

Imports ``jobs/``, ``devices/`` and the worker's shared modules (``exit_codes``, ``worker_args``);
the fork server runs the worker's ``main`` in each child it forks, and the worker imports this
room's ``lifeline`` and ``standby`` (its side of them).
"""
