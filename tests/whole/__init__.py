"""Tests of whole runs across every floor: faults, abuse, integrity, security, object stores."""
