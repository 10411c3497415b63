"""What clients talk to: the shared frontend path (`frontend.py`: admission, the
coordinator, text out), the gRPC Generation service and its request conversion, the
OpenAI-compatible HTTP API, authentication and interceptors, the admin service. The top of
the cluster below `server.py` and `cli.py`."""
