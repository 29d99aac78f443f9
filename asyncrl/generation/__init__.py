"""What a generator runs besides its engine: prompts, rewards, environments, models.

``tasks`` and ``data`` (with ``data_files``) make the prompts; ``rewards/`` scores
answers in a pool of worker processes; ``envs/`` holds the multi-turn environments
and the code sandbox; ``models``, ``lora`` and ``char_tokenizer`` build the policy;
``process_tree``, ``contained`` and ``plugin_check`` keep user code's processes in
bounds. Built on ``asyncrl.core`` and ``asyncrl.config`` only.
"""
