"""From an estimate to a plan: the largest batch or context that fits, the levers ranked,
the GPUs that fit, and the host memory the run needs."""
