"""The prefill worker: chunked prefill with a prefix cache, first token, KV sent to a decode worker."""
