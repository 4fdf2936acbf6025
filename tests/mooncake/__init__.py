"""Mooncake backend suite (run inside a private network namespace: scripts/test_mooncake.sh).

Imported as `tests.mooncake`, never with this folder on sys.path, where it would shadow the
`mooncake` wheel.
"""
