"""The RL math as pure tensor functions: no processes, no I/O, no config objects.

Everything here takes tensors and plain keyword arguments and returns float32
tensors, so each piece can be checked against a hand-worked example.

Shapes: ``B`` samples, ``T`` response positions. ``[B]`` is per sample,
``[B, T]`` per response token. ``mask`` ``[B, T]`` is 1/True where a token is
trained on; every function ignores whatever sits at masked positions.

Notation per token t (DESIGN.md, "Loss with importance correction")::

    pi_b      behavior policy: what the generator recorded when it sampled
    pi_prox   proximal policy: the learner at the start of this update
    pi_theta  the policy being optimized
    A_t       advantage

    r_t  = pi_theta / pi_prox                      PPO ratio (carries the gradient)
    rho_t = pi_prox / pi_b                         behavior ratio (detached)
    w_t  = correction(rho_t)                       none: 1, tis: min(rho, C),
                                                   mis: rho if rho <= C else 0,
                                                   decoupled: rho
    s_t  = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
    s_t  = max(s_t, c A_t)  where A_t < 0          dual clip, when c is set
    L    = agg_t[ -w_t s_t ]                       see :func:`aggregate`

Pieces:

- advantages: :func:`compute_advantages` (``grpo``, ``dr_grpo``, ``rloo``,
  ``reinforce_pp``, ``gae``) and :func:`token_level_rewards` (outcome reward on
  the last token, optional KL penalty in the reward);
- losses: :func:`policy_loss`, :func:`value_loss`, :func:`kl_estimate`
  (k1/k2/k3 to a frozen reference), :func:`entropy_from_logits`;
- :func:`aggregate`, which takes *global* normalizers so that micro-batch
  losses summed over gradient accumulation and data-parallel ranks equal the
  full-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Tensor = torch.Tensor

ADVANTAGES: dict[str, Callable[..., Tensor | tuple[Tensor, Tensor]]] = {}
"""Advantage estimators by config name (``algorithm.advantage``).

Outcome methods (``grpo``, ``dr_grpo``, ``rloo``) map ``rewards [B], group_ids
[B] -> [B]`` (one advantage per sample); token methods (``reinforce_pp``,
``gae``) map per-token rewards to ``[B, T]``. :func:`compute_advantages` is the
uniform entry point that dispatches here and broadcasts to tokens.
"""

OUTCOME_ADVANTAGES = frozenset({"grpo", "dr_grpo", "rloo"})
"""The methods that give one advantage per sample, broadcast to its tokens."""

CORRECTIONS = ("none", "tis", "mis", "decoupled")
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
KL_ESTIMATORS = ("k1", "k2", "k3")

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` so no ratio overflows (as verl does)."""


def register(table: dict, name: str) -> Callable[[Callable], Callable]:
    """Decorator: file ``fn`` in ``table`` under ``name``."""

    def wrap(fn: Callable) -> Callable:
        table[name] = fn
        return fn

    return wrap


# --------------------------------------------------------------------------
# masked reductions


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over positions where ``mask`` is set; 0 (not NaN) when nothing is set."""
    mask = mask.bool()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1).to(values.dtype)


def _masked_whiten(values: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the valid tokens of the batch; 0 where masked.

    The std is the population std (no Bessel correction). One valid token, or
    all-equal values, whiten to 0.
    """
    mask = mask.bool()
    mean = masked_mean(values, mask)
    centered = torch.where(mask, values - mean, torch.zeros_like(values))
    std = masked_mean(centered.square(), mask).sqrt()
    return centered / (std + eps)


# --------------------------------------------------------------------------
# advantages: outcome methods, one value per sample


def _group_members(group_ids: Tensor) -> list[Tensor]:
    """Boolean member masks, one per distinct group id (in sorted id order)."""
    return [group_ids == group for group in group_ids.unique()]


@register(ADVANTAGES, "grpo")
def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Reward minus its group's mean, divided by the group's std if asked.  [B] -> [B]

    GRPO's baseline is the other answers to the same prompt. The std is the
    population std (no Bessel correction). A group of one, or a group whose
    rewards are all equal, gets exactly 0: it says nothing about which answer
    was better (and dividing its rounding noise by ``eps`` would invent a signal).
    """
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    for members in _group_members(group_ids):
        group = rewards[members]
        if group.numel() < 2 or bool(group.max() == group.min()):
            continue
        centered = group - group.mean()
        if normalize_std:
            centered = centered / (group.std(unbiased=False) + eps)
        advantages[members] = centered
    return advantages


@register(ADVANTAGES, "dr_grpo")
def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO: reward minus its group's mean, never divided by the std.  [B] -> [B]

    Dividing by the std up-weights prompts that are nearly always solved or
    nearly always failed; Dr. GRPO drops it (pair it with the
    ``seq-mean-token-sum-norm`` aggregation to also drop the length bias).
    """
    return grpo_advantages(rewards, group_ids, normalize_std=False)


@register(ADVANTAGES, "rloo")
def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: reward minus the mean of the *other* samples of its group.  [B] -> [B]

    A leave-one-out baseline is independent of the sample itself, so the
    estimate is unbiased. With n samples, ``r_i - (S - r_i)/(n - 1)`` which is
    ``n/(n-1)`` times the group-centred reward. A group of one (no other
    sample) or of equal rewards gets 0.
    """
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    for members in _group_members(group_ids):
        group = rewards[members]
        n = group.numel()
        if n < 2 or bool(group.max() == group.min()):
            continue
        advantages[members] = group - (group.sum() - group) / (n - 1)
    return advantages


# --------------------------------------------------------------------------
# advantages: token methods


def token_level_rewards(
    rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Per-token rewards: the outcome reward on the last valid token, minus ``kl_coef * kl``.

    rewards [B], mask [B, T], kl [B, T] (e.g. :func:`kl_estimate` against the
    reference, detached) -> [B, T], 0 where masked. This is "KL in the
    reward": each valid token pays ``kl_coef * kl_t``. A row with no valid
    token has nowhere to put its reward and is all zeros.
    """
    mask = mask.bool()
    B, T = mask.shape
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(-1)  # [B]
    has_token = last >= 0
    out = torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    rows = torch.arange(B, device=mask.device)[has_token]
    out[rows, last[has_token]] = rewards.float().to(mask.device)[has_token]
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * torch.where(mask, kl.float(), torch.zeros_like(out))
    return out


def _discounted_reverse_cumsum(values: Tensor, mask: Tensor, discount: float) -> Tensor:
    """``out_t = x_t + discount * out_next`` over the valid tokens of each row.

    Masked positions are transparent: they add nothing and do not count as a
    step for the discount. The value after a row's last valid token is 0
    (terminal). 0 where masked.
    """
    mask = mask.bool()
    values = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    if discount == 1.0:
        out = values.flip(-1).cumsum(-1).flip(-1)
        return torch.where(mask, out, torch.zeros_like(out))
    out = torch.zeros_like(values)
    running = values.new_zeros(values.shape[0])
    for t in range(values.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], values[:, t] + discount * running, running)
        out[:, t] = running
    return torch.where(mask, out, torch.zeros_like(out))


@register(ADVANTAGES, "reinforce_pp")
def reinforce_pp_advantages(
    token_rewards: Tensor, mask: Tensor, gamma: float = 1.0, eps: float = 1e-6
) -> Tensor:
    """REINFORCE++: discounted return-to-go, whitened over the batch's valid tokens.  [B, T]

    ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over valid tokens (the per-token
    rewards carry the KL penalty when it is in the reward), then
    ``(G - mean) / (std + eps)`` with mean and std over all valid tokens of the
    batch: a global baseline instead of a critic or a group.
    """
    returns = _discounted_reverse_cumsum(token_rewards, mask, gamma)
    return _masked_whiten(returns, mask, eps)


@register(ADVANTAGES, "gae")
def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """PPO with a critic: GAE(gamma, lambda) over the valid tokens.  -> (advantages, returns)

    ``delta_t = r_t + gamma V_next - V_t`` with ``V_next`` the value at the
    next *valid* token (0 after the last one: the episode ends there, also
    when it was cut at the length limit), ``A_t = delta_t + gamma lam A_next``.
    The value-head targets are ``returns = A + V`` (before whitening). As PPO
    implementations do, the advantages are then whitened over the valid
    tokens of the batch — so call this on the whole batch, not per micro-batch.
    """
    mask = mask.bool()
    values = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    B, T = mask.shape
    # index of the next valid token after t (T when none): reverse running minimum
    positions = torch.arange(T, device=mask.device).expand(B, T)
    valid_at = torch.where(mask, positions, torch.full_like(positions, T))
    after = torch.cat([valid_at[:, 1:], valid_at.new_full((B, 1), T)], dim=1)
    next_valid = after.flip(-1).cummin(-1).values.flip(-1)  # [B, T]
    padded = torch.cat([values, values.new_zeros(B, 1)], dim=1)  # value T is terminal: 0
    next_values = padded.gather(1, next_valid)
    deltas = token_rewards.float() + gamma * next_values - values
    advantages = _discounted_reverse_cumsum(deltas, mask, gamma * lam)
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return _masked_whiten(advantages, mask, eps), returns


def compute_advantages(
    name: str,
    *,
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    normalize_std: bool = True,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor | None]:
    """Per-token advantages for any method in :data:`ADVANTAGES`.  -> (advantages [B, T], returns)

    rewards [B] (scalar outcome), group_ids [B] (samples of one prompt share
    an id), mask [B, T]. ``token_rewards`` [B, T] (see
    :func:`token_level_rewards`), when given, replaces the scalar rewards:
    outcome methods then use its masked row sum as the sample's reward.
    ``values`` [B, T] (the critic, old values) is required by ``gae``.

    Outcome methods broadcast the sample's advantage to all its tokens.
    ``returns`` are the value-head targets: ``gae`` only, ``None`` otherwise.
    Advantages are 0 where ``mask`` is 0. Whitening (``reinforce_pp``,
    ``gae``) is over the whole input, so pass the whole batch.
    """
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage {name!r}; expected one of: {', '.join(ADVANTAGES)}")
    mask = mask.bool()
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if name in OUTCOME_ADVANTAGES:
        if token_rewards is not None:
            rewards = torch.where(mask, token_rewards.float(), zeros).sum(-1)
        if name == "grpo":
            per_sample = grpo_advantages(rewards, group_ids, normalize_std, eps)
        else:
            per_sample = ADVANTAGES[name](rewards, group_ids)
        return torch.where(mask, per_sample.float().unsqueeze(-1).expand_as(zeros), zeros), None
    if token_rewards is None:
        token_rewards = token_level_rewards(rewards, mask)
    if name == "reinforce_pp":
        return reinforce_pp_advantages(token_rewards, mask, gamma, eps), None
    if values is None:
        raise ValueError("advantage 'gae' needs the critic's values [B, T]")
    return gae_advantages(token_rewards, values, mask, gamma, lam, eps)


# --------------------------------------------------------------------------
# aggregation


def _normalizer(given: float | Tensor | None, default: float | Tensor) -> float | Tensor:
    """``given`` (a global count), else the local ``default``; never below 1."""
    value = default if given is None else given
    if isinstance(value, Tensor):
        return value.float().clamp(min=1.0)
    return max(float(value), 1.0)


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    norm_length: int | None = None,
) -> Tensor:
    """Reduce per-token losses [B, T] to a scalar.

    Every mode is a sum over this input's rows divided by a normalizer, so a
    batch split into micro-batches (and over data-parallel ranks) gives the
    full-batch loss and gradient when the losses are *summed* and each call
    gets the *global* normalizers:

    - ``token-mean``: ``sum(x * m) / num_tokens`` (default: valid tokens here);
    - ``seq-mean-token-mean``: ``sum_b mean_t(x_b) / num_sequences``; a row
      with no valid token contributes 0 (default ``num_sequences``: rows here);
    - ``seq-mean-token-sum``: ``sum_b sum_t(x_b) / num_sequences``;
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): ``sum(x * m) / (num_sequences *
      norm_length)``, a constant normalizer free of length bias (default
      ``norm_length``: T here).

    Masked positions never contribute, not even a NaN. All-masked gives 0.
    """
    mask = mask.bool()
    values = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    B, T = mask.shape
    if mode == "token-mean":
        return values.sum() / _normalizer(num_tokens, mask.sum())
    if mode == "seq-mean-token-mean":
        lengths = mask.sum(-1).clamp(min=1).to(values.dtype)
        return (values.sum(-1) / lengths).sum() / _normalizer(num_sequences, B)
    if mode == "seq-mean-token-sum":
        return values.sum() / _normalizer(num_sequences, B)
    if mode == "seq-mean-token-sum-norm":
        length = _normalizer(norm_length, T)
        return values.sum() / (_normalizer(num_sequences, B) * length)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of: {', '.join(AGGREGATIONS)}")


# --------------------------------------------------------------------------
# losses


def _behavior_log_ratio(
    proximal_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, level: str
) -> Tensor:
    """log(pi_prox / pi_b) per token, or per sequence (the log of the geometric mean)."""
    log_rho = (proximal_logprobs.float() - behavior_logprobs.float()).detach()
    log_rho = torch.where(mask, log_rho, torch.zeros_like(log_rho))
    if level == "token":
        return log_rho
    if level == "sequence":
        lengths = mask.sum(-1, keepdim=True).clamp(min=1).to(log_rho.dtype)
        per_sequence = log_rho.sum(-1, keepdim=True) / lengths  # [B, 1]
        return torch.where(mask, per_sequence.expand_as(log_rho), torch.zeros_like(log_rho))
    raise ValueError(f"unknown correction_level {level!r}; expected one of: token, sequence")


def policy_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    correction: str = "tis",
    correction_level: str = "token",
    correction_cap: float = 2.0,
    aggregation: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate with a behavior correction.  -> (loss, stats)

    logprobs [B, T] (with grad: pi_theta), proximal_logprobs [B, T] (pi_prox),
    behavior_logprobs [B, T] (pi_b, as the generator recorded them),
    advantages [B, T] ([B] is broadcast), mask [B, T].

    The generator's tokens come from pi_b, which may be several versions old
    (and is numerically a different engine), so the loss weights each token
    by ``w = correction(pi_prox / pi_b)`` (detached):

    - ``none``: w = 1. Trains off-policy tokens as if on-policy — an ablation;
    - ``tis``: w = min(rho, C), truncated importance sampling;
    - ``mis``: w = rho where rho <= C, else 0 (the token drops out of the
      loss but still counts in the normalizer, which is global);
    - ``decoupled``: w = rho untruncated, AReaL's decoupled PPO objective.
      The trainer recomputes ``proximal_logprobs`` with one extra forward pass
      at the start of the update; with one optimizer step per batch that is
      simply the current policy, detached.

    ``correction_level="sequence"`` uses one rho per sequence, the geometric
    mean of its token ratios ``exp(mean_t log rho_t)``, truncated or masked by
    that value. The clip is asymmetric (``clip_low``, ``clip_high``, DAPO's
    clip-higher), and ``clip_c`` (> 1) adds the dual clip: for A < 0 the
    surrogate is at least ``clip_c * A``, so a huge ratio on a bad token cannot
    blow up the loss. See :func:`aggregate` for ``aggregation`` and the global
    normalizers. Log-ratios are clamped to +-20 before ``exp``.

    Stats (detached, over this call's valid tokens): ``clip_frac`` (the clip
    removed the gradient), ``dual_clip_frac``, ``importance_weight_mean`` and
    ``importance_weight_max`` (rho before correction, at the chosen level),
    ``importance_truncated_frac`` (rho > C: truncated by tis, masked by mis,
    and for none/decoupled how many would be), ``importance_applied_mean``
    (mean w), ``ppo_kl`` (k3 estimate of KL(pi_prox || pi_theta)).
    """
    if correction not in CORRECTIONS:
        raise ValueError(
            f"unknown correction {correction!r}; expected one of: {', '.join(CORRECTIONS)}"
        )
    mask = mask.bool()
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = torch.where(mask, advantages.float().detach().expand_as(zeros), zeros)

    log_ratio = torch.where(mask, logprobs.float() - proximal_logprobs.float().detach(), zeros)
    ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    unclipped = ratio * advantages
    clipped = clipped_ratio * advantages
    surrogate = torch.minimum(unclipped, clipped)
    if clip_c is not None:
        if clip_c <= 1.0:
            raise ValueError(f"clip_c must be > 1, got {clip_c}")
        floor = clip_c * advantages
        dual = (advantages < 0) & (floor > surrogate)
        surrogate = torch.where(dual, floor, surrogate)
    else:
        dual = torch.zeros_like(mask)

    log_rho = _behavior_log_ratio(proximal_logprobs, behavior_logprobs, mask, correction_level)
    rho = log_rho.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    over_cap = rho > correction_cap
    if correction == "none":
        weight = torch.ones_like(rho)
    elif correction == "tis":
        weight = rho.clamp(max=correction_cap)
    elif correction == "mis":
        weight = torch.where(over_cap, torch.zeros_like(rho), rho)
    else:  # decoupled
        weight = rho

    loss = aggregate(
        -weight * surrogate,
        mask,
        aggregation,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        norm_length=norm_length,
    )
    with torch.no_grad():
        lr = log_ratio.detach()
        stats = {
            "clip_frac": masked_mean((clipped < unclipped).float(), mask),
            "dual_clip_frac": masked_mean(dual.float(), mask),
            "importance_weight_mean": masked_mean(rho, mask),
            "importance_weight_max": torch.where(mask, rho, torch.zeros_like(rho)).amax(),
            "importance_truncated_frac": masked_mean(over_cap.float(), mask),
            "importance_applied_mean": masked_mean(weight, mask),
            "ppo_kl": masked_mean(torch.expm1(lr.clamp(max=LOG_RATIO_LIMIT)) - lr, mask),
        }
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    aggregation: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: ``0.5 * max((v - R)^2, (clip(v, old +- clip) - R)^2)``.

    values [B, T] (with grad), old_values [B, T] (the critic when the batch's
    advantages were computed), returns [B, T] (:func:`compute_advantages`'s
    targets), mask [B, T]. The clip keeps the critic from moving further than
    ``clip`` from its old prediction in one update; ``clip=None`` gives the
    plain squared error. Stats: ``value_clip_frac`` (the clipped branch was the
    larger), ``value_error`` (mean of (v - R)^2 over valid tokens).
    """
    mask = mask.bool()
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    values = torch.where(mask, values.float(), zeros)
    old_values = torch.where(mask, old_values.float().detach(), zeros)
    returns = torch.where(mask, returns.float().detach(), zeros)
    error = (values - returns).square()
    if clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped_error = (clipped_values - returns).square()
        per_token = 0.5 * torch.maximum(error, clipped_error)
        clip_used = clipped_error > error
    else:
        per_token = 0.5 * error
        clip_used = torch.zeros_like(mask)
    loss = aggregate(
        per_token,
        mask,
        aggregation,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        norm_length=norm_length,
    )
    with torch.no_grad():
        stats = {
            "value_clip_frac": masked_mean(clip_used.float(), mask),
            "value_error": masked_mean(error.detach(), mask),
        }
    return loss, stats


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.  [B, T]

    With ``x = logprobs - ref_logprobs`` (Schulman, "Approximating KL
    divergence"): ``k1 = x`` (unbiased, can be negative), ``k2 = x^2 / 2``
    (low variance, biased), ``k3 = exp(-x) - 1 + x`` (unbiased, never
    negative). Differentiable in ``logprobs``: in the loss add
    ``kl_coef * aggregate(kl, mask, ...)``; in the reward pass it detached to
    :func:`token_level_rewards`. ``x`` is clamped to +-20 inside ``exp``.
    """
    log_ratio = logprobs.float() - ref_logprobs.float().detach()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return (-log_ratio).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp() - 1.0 + log_ratio
    raise ValueError(
        f"unknown KL estimator {estimator!r}; expected one of: {', '.join(KL_ESTIMATORS)}"
    )


ENTROPY_CHUNK_ELEMENTS = 1 << 24
"""Without grad, :func:`entropy_from_logits` works on this many logits at a time (64 MiB fp32)."""


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) at each position.  [B, T, V] -> [B, T]

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, which never forms
    ``log_softmax`` and ``softmax`` together. Gradient mode is the caller's:
    under ``torch.no_grad()`` (a metric) the rows are done in chunks so the
    float32 temporaries stay small; with grad (an entropy bonus) in one pass.
    """
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])

    def entropy(rows: Tensor) -> Tensor:
        z = rows.float() / temperature
        return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)

    if torch.is_grad_enabled() and logits.requires_grad:
        return entropy(flat).reshape(shape)
    chunk = max(1, ENTROPY_CHUNK_ELEMENTS // max(1, flat.shape[-1]))
    parts = [entropy(flat[start : start + chunk]) for start in range(0, flat.shape[0], chunk)]
    if not parts:
        return torch.zeros(shape, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(shape)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob of each target token under softmax(logits / temperature).  [B, T, V] -> [B, T]"""
    logits = logits.float() / temperature
    return torch.gather(logits.log_softmax(-1), -1, targets.unsqueeze(-1)).squeeze(-1)
