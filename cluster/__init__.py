"""The cluster layer: everything above the workers, one sub-folder per concern.

Lowest first (a folder imports only from folders below it; `lint-imports` holds this):
`settings/` (the serve config and its flags) and `clients/` (gRPC, HTTP and admin clients)
and `sim/` (the simulator, step costs and their commands); `serving/` (the request path: the
coordinator, seats, token streams, router, KV index, pools, health, metrics); `scaling/`
(elastic pools and the planner); `api/` (the gRPC and HTTP APIs over the shared frontend path,
authentication, the admin service). At the top: `cli.py` (the `pdserve` command), `server.py`
(assembles one serving process), `ray_driver.py` and `bench/` (the load generator).
"""
