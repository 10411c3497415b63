"""The models: one file per family on shared blocks (layers, MoE, rotary, FP8 linear layers),
found through a registry keyed by the Hugging Face architecture; the weights' sources and
loading; tensor parallelism's plan and links (`parallel.py`)."""
