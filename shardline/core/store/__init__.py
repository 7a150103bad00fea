"""Request state in Redis: the record of a request, its Lua scripts and the store that writes it."""
