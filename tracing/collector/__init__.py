"""The tracing service, `shardline serve tracing`: an OTLP receiver that stores spans in
Redis, the trace dashboard and a native Perfetto trace writer.
"""
