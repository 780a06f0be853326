"""Measurements of the library's kernels: the flash-a2a benchmark (``xstage bench flash-a2a``) with its
timing, hiding-ratio statistics, spans analysis and report; the attention baselines it compares against
(flash-attn-4, cuDNN); and the clock, power and SASS probes. Each module runs as ``python -m benchmarks.X``.

Imports point down: this package imports the library (flash_a2a, calibrate, cute_kernels), never the reverse.
"""
