"""Other APIs in terms of chat completions: the Responses API, Anthropic's Messages API and legacy
completions, each translated to a chat request and back.
"""
