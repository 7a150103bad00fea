"""The whole stack on one machine, as child processes: what `shardline up` and the tests run."""
