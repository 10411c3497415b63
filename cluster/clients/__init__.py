"""Clients of a running server: gRPC, OpenAI-compatible HTTP, the admin API, and the
credentials they present. Imports only `settings/` of the cluster."""
