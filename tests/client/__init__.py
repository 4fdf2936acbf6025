"""Client library tests: real kvtag server on loopback, canonical key vectors."""
