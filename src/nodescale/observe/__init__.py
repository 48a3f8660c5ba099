"""Observability of a run: metric loggers (sinks), the device monitor and the profiler."""
