"""The tokenizer library: the model's tokenizer, chat templates and incremental detokenizing.

The tokenizer service serves it over gRPC; the worker (structured output's vocabulary) and
`shardline generate` without a stack use it in-process.
"""
