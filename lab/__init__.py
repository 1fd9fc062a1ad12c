"""What emulates and measures: device and link profiles, traces, workloads, benchmarks."""
