"""Discrete-event simulator with a fluid network: runs scheduling plans on a modelled cluster."""

from .engine import SimResult, Simulation, simulate

__all__ = ["SimResult", "Simulation", "simulate"]
