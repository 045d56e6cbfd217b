"""Tests of the job contract, the job function, models, kinds and the vector cache (jobs/)."""
