"""The client's one logger: every part of StoreClient logs through it, under the name users (and
tests) already configure, so one logging setting covers the whole client."""

from __future__ import annotations

import logging

log = logging.getLogger("kvtag_client.store")
