"""Where a request enters: the servicer, request intake and admission, validation, and the request codec."""
