"""The GPU-readiness sensor (wait_gpu_ready)."""
