"""The Explorer's HTTP surface: dependencies, route handlers (thin: parse, call a service, map the
result) and the mapping of its exceptions to OpenAI-shaped errors.
"""
