"""Shardline's tracing library, imported by every service: OpenTelemetry setup,
trace-context propagation over gRPC, span attribute names and the Prometheus
metrics shared by the services. The tracing service itself (OTLP receiver, span
store, dashboard, Perfetto export) is ``tracing.collector``, which services
never import.

Import the submodules directly (``tracing.otel_setup``, ``tracing.grpc_context``,
...), so a service that only needs attribute names does not pull in the
OpenTelemetry SDK.
"""
