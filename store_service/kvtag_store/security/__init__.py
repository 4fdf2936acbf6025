"""Who may call: tokens, the access interceptor, TLS and the security flags."""
