"""The services' shared library: Redis request state, gRPC serving, text and GGUF reading, errors.

It imports no service, and the SDK does not import it: see the layers in pyproject.toml."""
