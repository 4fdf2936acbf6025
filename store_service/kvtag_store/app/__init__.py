"""The process: the command line, the gRPC server's assembly, and the operator's terminal view."""
