"""Where a request enters: the servicer (a few lines per RPC) over the modules that do each job (session_desk,
lookups, reads, writes, slots, leases, counting, replies), request intake and admission, validation, and the
request codec."""
