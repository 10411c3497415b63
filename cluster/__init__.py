"""The cluster layer: CLI, and (later) router, Ray pools, gRPC frontend and metrics."""
