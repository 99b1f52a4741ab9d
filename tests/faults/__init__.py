"""The fault suite: trials that break flare on purpose (kills, corruption, full disks, hosts at
once, hostile input) and the invariants checked after each. `tests/bench/soak.py` runs them at
seeded random points for minutes; `test_faults.py` runs a fast seeded subset in CI."""
