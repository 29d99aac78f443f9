"""Guess the number: a multi-turn environment written from scratch.

Config::

    environment:
      name: examples/custom_env.py:GuessNumberEnv
      max_turns: 6
      kwargs: {low: 1, high: 100}

Each dataset row holds the secret in ``reward_model.ground_truth``. The model
guesses; the environment answers "higher" or "lower" until it is right. The
reward is 1 for a right guess, less 0.1 for each extra turn it took.
"""

import re

from asyncrl.generation.envs import Environment, StepResult


class GuessNumberEnv(Environment):
    def __init__(self, low: int = 1, high: int = 100):
        self.low, self.high = low, high

    def reset(self, row):
        self.secret = int(row["reward_model"]["ground_truth"])
        self.turns = 0
        task = (
            f"I am thinking of a whole number from {self.low} to {self.high}. "
            "Guess it; answer with just the number. I will say higher or lower."
        )
        return [{"role": "user", "content": task}]

    def step(self, response):
        self.turns += 1
        numbers = re.findall(r"-?\d+", response)
        if not numbers:
            return StepResult([{"role": "user", "content": "Answer with a whole number."}])
        guess = int(numbers[-1])
        if guess == self.secret:
            return StepResult(done=True, reward=max(0.0, 1.0 - 0.1 * (self.turns - 1)))
        hint = "Higher." if guess < self.secret else "Lower."
        return StepResult([{"role": "user", "content": hint}])
