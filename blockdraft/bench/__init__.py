"""Benchmarks.

`blockdraft bench` (command.py): transformers generate vs the z-lab dflash reference vs our plain and
DFlash decoding on one device, from random-weight real shapes (shapes.py, random_weights.py) or a
real model (workload.py); engines/ (one module per engine), forced.py (forced acceptance),
measure.py (timing and parity), suite.py (the matrix), report.py (JSON, ratios, criteria, table),
plot.py (PNG). cpu_vs_hf.py: the CPU comparison with transformers in separate processes.
"""
