"""Batch jobs, OpenAI's Batch API: what the gateway (which takes the files and batches) and the batch
workers (Celery, batch_svc/, which run them) share: the file store, the batch records in Redis, the
line formats and the Celery wiring."""
