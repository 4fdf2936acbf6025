"""Backend contract tests shared by every storage backend."""
