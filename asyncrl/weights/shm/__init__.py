"""The shared-memory weight path, for replicas on the learner's host.

``segment`` declares the segment's layout and checks; the learner's ``publisher``
writes each version once with ``writer``; replicas load it in place with ``reader``."""
