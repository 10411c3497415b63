"""The request path below the APIs: the coordinator (one request's attempts across a
prefill and a decode worker), decode seats, token streams, the router and its KV index, the
worker pools and their health, the errors a request meets, the Prometheus metrics. Imports
`settings/` and `sim/` of the cluster, never the APIs or scaling."""
