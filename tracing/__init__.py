"""Shardline tracing: OpenTelemetry setup, trace-context propagation over gRPC,
an OTLP receiver that stores spans in Redis, a native Perfetto trace writer and
the Prometheus metrics shared by the services.

Import the submodules directly (``tracing.otel_setup``, ``tracing.grpc_context``,
...), so a service that only needs attribute names does not pull in Redis or
the Perfetto protos.
"""
