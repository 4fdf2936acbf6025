"""The memory backend's disk tier: self-describing records in per-tenant segment files (records.py,
layout.py, segments.py), written in the background and read back on a Get (tier.py)."""
