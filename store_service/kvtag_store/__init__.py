"""kvtag store service: stores KV-cache blocks tagged with the hashing mode that keyed them."""
