"""The public gRPC API: the Generation and Batches services, and the gateway's own gRPC health."""
