"""asyncrl: asynchronous RL for LLMs.

Generator pools stream trajectories over ZeroMQ into a versioned,
staleness-bounded buffer while a learner trains continuously and pushes
weights back. See DESIGN.md for the roles and their guarantees.
"""

__version__ = "0.1.0"
