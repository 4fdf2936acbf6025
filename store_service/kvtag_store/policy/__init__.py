"""The mode policy: sessions, the census of modes per namespace, mode diffs and the base-key index."""
