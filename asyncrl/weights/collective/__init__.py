"""The collective weight path: learner rank 0 broadcasts into each replica's engine.

``groups`` makes one pairwise group per replica (who may join, and how); the
learner's ``sender`` streams a version in ``buckets`` (``outgoing`` holds what is
being sent); a replica's ``receiver`` loads it into the engine."""
