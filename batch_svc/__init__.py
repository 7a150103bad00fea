"""The batch service: Celery workers that run the Batch API's jobs, chunk by chunk, through the
gateway at a low priority, keeping each line's result in Redis once."""
