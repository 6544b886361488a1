"""Measurements every run takes: FLOPs / MFU (flops.py), memory (memory.py), bubble (bubble.py)."""
