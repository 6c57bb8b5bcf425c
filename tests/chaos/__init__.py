"""Chaos scenarios: the whole stack under seeded random faults (see `runner`)."""
