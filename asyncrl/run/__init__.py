"""The top layer: what starts, watches and stops the roles.

``cli`` is ``asyncrl``'s command line; ``launch`` checks a config and starts a run,
``local_run`` on this machine and ``ray/`` on a Ray cluster, both under one
supervision policy (``supervision``, ``closing``, ``watchdog``); ``roles`` is each
process's entry point; ``preflight``, ``console`` and ``status`` are what a user sees.
"""
