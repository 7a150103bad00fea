"""The output processor: the Subscribe stream of every request's tokens, turned into text and chunks once per step."""
