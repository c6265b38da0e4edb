"""Plugins of every test run: the warnings ledger (tests/support/warnings_ledger.py), which fails
a run that shows a warning nobody has explained."""

pytest_plugins = ["tests.support.warnings_ledger"]
