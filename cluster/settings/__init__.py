"""The serve configuration: `ServeConfig` and its sections, the pools' config, the YAML tree
and the CLI flags that override it. Imports nothing else of the cluster."""
