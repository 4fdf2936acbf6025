"""kvtag client: a thin gRPC client for the kvtag store and a vLLM KV connector."""
