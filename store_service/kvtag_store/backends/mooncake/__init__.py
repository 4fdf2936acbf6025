"""The Mooncake Store backend: the client's interface, the backend facade over its reads, writes,
shared-memory half, health and leases, plus value format, error codes, census and options
(docs/mooncake.md)."""
