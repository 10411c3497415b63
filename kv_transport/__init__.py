"""Moving KV blocks between workers (being built: UCX transport, loopback)."""
