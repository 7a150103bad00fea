"""The request runner, shared by both APIs: admit, validate, tokenize and submit a request, then follow it."""
