"""Service suite: a real kvtag-store server on loopback through real gRPC stubs."""
