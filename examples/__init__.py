"""Examples and the main job; `data` and `models` are shared with the benchmarks."""
