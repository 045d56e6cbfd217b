"""What an operator uses on runs and on the machine, beside running them: the store's runs and
``clean`` (``run_list``), ``report``, ``export``, ``doctor`` and the ``dashboard``. Each reads what
the supervisor leaves in the store and Redis; none is part of a run, and only the command line uses
them."""
