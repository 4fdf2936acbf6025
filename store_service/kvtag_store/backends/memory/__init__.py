"""The embedded memory backend: values in arena slots, evicted LRU per pool, checksummed.

backend.py is the facade (the BlockBackend contract); entries.py holds a namespace's blocks, pins and
key index; pools.py the pools and their LRU order; allocation.py slots and eviction; reservations.py
the two-phase shared-memory put; reads.py the verified Get paths; census.py the in-process census.
"""

from kvtag_store.backends.memory.backend import MemoryBackend
from kvtag_store.backends.memory.census import MemoryCensus

__all__ = ["MemoryBackend", "MemoryCensus"]
