"""Benchmarks of torch_convbias against nn.Conv2d (run as ``python -m bench.<name>`` from the repository root)."""
