"""Structured outputs: constrain a request's output to a JSON Schema, a regex, a choice or a grammar
(params: the user's description; grammar: llguidance masks and grammar state per request)."""
