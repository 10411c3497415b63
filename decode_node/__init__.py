"""The decode worker: receives prompts' KV from prefill workers and runs continuous batching.

It is also the colocated ("mixed") worker: `submit` prefills locally.
"""
