"""The decode worker (Ray actor): KV receive, continuous batching, speculation, token streaming. Built by the cluster issue."""
