"""Benchmarks, measured beside their anchors in one run. `python -m benchmarks [--quick] [NAME ...]`."""
