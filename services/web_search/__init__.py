"""The web-search service: SearXNG results, summarised by a local model, with a fallback.

``search.py`` and ``summary.py`` (and ``takeover.py``) are pure: the query, the parsing, the
prompt, the fallback text, what to do with a redelivered task. ``searxng.py`` is the HTTP
client; ``service.py`` the worker on the bus.
"""
