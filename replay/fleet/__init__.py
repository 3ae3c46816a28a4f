"""A replay spread over worker processes (``agentload replay --workers N``).

``local`` runs the shards as processes on this host; the driver (the process the user
started) keeps the server, the samplers, the dashboard and the run directory.
"""
