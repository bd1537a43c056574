"""Gradient synchronisation as workers see it: aggregators, the DDP hook, per-parameter sync."""
