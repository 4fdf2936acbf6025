"""CLI/environment options of the Mooncake backend, importable without Mooncake installed.

The serve command adds these flags unconditionally and calls `build` only for
`--backend mooncake`, so the import of the Mooncake wheel stays lazy.
"""

from __future__ import annotations

import argparse

from kvtag_store.backends.base import BlockBackend, CensusStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the --mooncake-* flags (each also read from a KVTAG_MOONCAKE_* environment variable)."""
    parser.add_argument("--mooncake-master", default=None, help="Mooncake master RPC address HOST:PORT")


def build(args: argparse.Namespace) -> tuple[BlockBackend, CensusStore]:
    """Connect to the Mooncake cluster named by the flags."""
    raise NotImplementedError("the mooncake backend is not implemented yet")
