"""The public gRPC API (pdserve.v1) and its generated stubs. Built by the cluster issue."""
