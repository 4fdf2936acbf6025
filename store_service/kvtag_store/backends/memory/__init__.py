"""The embedded memory backend: namespaces and entries, pools and eviction, reservations, pins."""
