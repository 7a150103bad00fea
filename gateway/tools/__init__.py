"""Tool calling: the tools a chat request brings, the constraint they put on its output, the calls read out of it."""
