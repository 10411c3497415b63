"""The prefill worker (Ray actor): chunked prefill, prefix cache, KV send. Built by the cluster issue."""
