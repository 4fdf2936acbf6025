"""The shared-memory data path: values move through the store's arena; messages carry slot references."""
