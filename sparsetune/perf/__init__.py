"""Performance measurement: the timing harness, the fit check, eval's speed case, the step profiler."""
