"""The Batch API's rules and HTTP routes: files and batches, run by the batch workers."""
