"""Running a step on the device: the engine's parts assembled (`assembly.py`), one rank's
model and pool (`executor.py`), a step's inputs, CUDA graphs, the model runner (inputs ->
forward -> logits -> sampling) and tensor parallelism's other ranks."""
