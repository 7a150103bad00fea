"""Tenancy: API keys, tenants (weights, classes, SLOs) and their limits, shared by every gateway through Redis."""
