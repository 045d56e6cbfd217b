"""The corpus: a corpus file read as records (``records``: JSON Lines, CSV, Parquet, text; ids,
fields, limits, each malformed line named by file and line) and a run's corpus files (``files``:
their checksums and versions, that they did not change, and the corpus read again for export).

The first room of ``supervisor/``: imports ``jobs/`` only, so submit and the readers of a published
result (export's ``--columns``) share one reader without either importing the other.
"""
