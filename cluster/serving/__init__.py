"""The request path below the APIs: the coordinator (one request's attempts across a
prefill and a decode worker), the worker set (the one owner of the pools, seats, streams and
KV index, and of a worker's leaving), decode seats, token streams, the router and its KV index, the
worker pools and their health, the errors a request meets, the Prometheus metrics. Imports
`settings/` and `sim/` of the cluster, never the APIs or scaling."""
