"""Fusion search: which ops become one kernel (legality), and whether that pays (cost)."""
from ortfuse.search.plan import Plan, Region, Reject, Traffic
from ortfuse.search.regions import plan

__all__ = ["Plan", "Region", "Reject", "Traffic", "plan"]
