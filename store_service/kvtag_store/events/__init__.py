"""KV events: the store publishes the blocks entering and leaving it in vLLM's own event format, one
topic per namespace and hashing mode (docs/kv-events.md)."""
