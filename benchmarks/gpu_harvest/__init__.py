"""The GPU harvest: on one CUDA GPU, record what vramplan's device model needs (process
floor, NVML counters, cuBLAS and cuDNN workspaces), run the accuracy study and calibrate.

    python -m benchmarks.gpu_harvest --quick --out /tmp/harvest

See ``benchmarks/gpu_harvest/README.md``.
"""
