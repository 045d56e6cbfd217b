"""Tests of submit, watch, retries, the ledger and assembly (supervisor/)."""
