"""Chaos tests: real processes killed, cut off or flooded, and every output checked."""
