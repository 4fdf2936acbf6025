"""Bounds of a HeartbeatRequest's UsageReport (a companion engine's census report), shared by the
client that keeps its pending lists within them and the service that refuses a report beyond them."""

from __future__ import annotations

# Entries of UsageReport.stored_base_keys, and of missed_base_keys, in one report.
MAX_USAGE_BASE_KEYS = 4096
# Missed blocks' base keys a companion samples per request (its first misses: the prefix another
# mode most likely stored).
MISSED_SAMPLE_PER_REQUEST = 8
