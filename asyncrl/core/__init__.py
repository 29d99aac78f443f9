"""The bottom layer: what every process needs and nothing else.

The wire (``messages``, ``wire``, ``weight_messages``, ``trajectory``), sockets and
their limits (``transport``, ``message_limits``, ``connection_guard``), keys and
signatures (``security``, ``credentials``, ``keys_folder``, ``signing``), and the small
helpers every role uses (``paths``, ``progress``, ``stop_signals``, ``waiting``,
``reductions``, ``tracking``, ``yaml_files``, ``machine``, ``cores``). Nothing here
imports a reward, an environment, a role or the launcher.
"""
