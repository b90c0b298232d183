"""Speed and memory: the kernels' benchmark and GPU check, the memory planner and its tracer,
the real-size scale check, and the builders (modelzoo.py: real-size configurations, tiny local
models) that these tools and the tests share. Nothing here is imported by recast.py."""
