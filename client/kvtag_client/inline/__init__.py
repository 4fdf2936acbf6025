"""The inline data path: values travel in gRPC Put and Get messages, encoded and read by hand."""
