"""Client-library tests that need a real vLLM (run with .venv-vllm)."""
