"""The fleet's pure rules, which every service may apply: no I/O, no clock, no service imports.

``liveness`` (is a registry entry fresh), ``policy`` (which worker gets a task), ``domains``
(the domain of a prompt), ``aliases`` (model names to statistics keys). A rule two services
apply lives here once, so the router, the reaper, the workers and the CLI cannot disagree.
"""
