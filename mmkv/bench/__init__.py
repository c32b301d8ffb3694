"""Benchmarks: ``python -m mmkv.bench <name> [--json]``; the last line of ``--json`` output is one
JSON object."""
