"""Plugins of every test run: the warnings ledger (tests/support/warnings_ledger.py), which fails
a run that shows a warning nobody has explained; the workers' share of the CPUs
(tests/support/worker_threads.py), so that xdist's workers do not oversubscribe torch's threads."""

pytest_plugins = ["tests.support.warnings_ledger", "tests.support.worker_threads"]
