"""The GPU worker service: one tensor-parallel engine behind `shardline.v1.Worker`."""
