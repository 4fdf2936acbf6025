"""Storage backends: the embedded memory store and the Mooncake Store adapter."""
