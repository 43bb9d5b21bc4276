"""Serving a chat request: its preparation and generation (the chat service), the agents' adapters and
episode pins, demonstrations, and the engines that generate.
"""
