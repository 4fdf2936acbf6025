"""The Mooncake Store backend: value format, error codes, backend, census and options (docs/mooncake.md)."""
