"""Capture: the frozen target, data rendering, feature contracts, capture server, feature store."""
