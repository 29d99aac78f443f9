"""The RL math as pure tensor functions: no processes, no I/O; only the registry sees configs.

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
                                                   icepop: rho if floor <= rho <= C
                                                   else 0, decoupled: rho
    s_t  = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
    s_t  = max(s_t, c A_t)  where A_t < 0          dual clip, when c is set
    L    = agg_t[ -w_t s_t ]                       see :func:`aggregate`

That is the ``ppo`` surrogate; ``algorithm.policy_loss`` picks another (gspo, cispo,
sapo, gmpo, reinforce: :mod:`.surrogates`), with the same w and aggregation.

Modules, one job each:

- :mod:`.registry`: the typed registries (advantage estimators, corrections,
  aggregations, KL estimators, policy losses), what each entry needs, and
  :func:`needs_of`, which is how the learner asks what a config needs (values,
  per-token rewards, a reference);
- :mod:`.advantages`: the estimators, :func:`compute_advantages` (the uniform entry
  point) and :func:`token_level_rewards` (outcome reward on the last token, optional
  KL penalty in the reward);
- :mod:`.policy_loss`: :func:`policy_loss`, the configured surrogate with a behavior
  correction; :mod:`.surrogates`: the surrogates (ppo, gspo, cispo, sapo, gmpo,
  reinforce); :mod:`.corrections`: the behavior corrections, :func:`behavior_weights`
  and :func:`batch_weight_scale` (rho per token, per sequence as the product, or as
  the geometric mean);
- :mod:`.rejection`: :func:`rejection_keep` (rejection sampling) and :func:`m2po_keep`
  (M2PO), masks that drop tokens too far off-policy; :mod:`.off_policy`:
  :func:`off_policy_metrics`, verl's off-policy diagnostics;
- :mod:`.value`: :func:`value_loss`; :mod:`.kl`: :func:`kl_estimate` (k1/k2/k3/abs to
  a frozen reference); :mod:`.kl_control`: the in-reward KL coefficient, fixed or
  adaptive (:func:`make_kl_controller`, :func:`batch_kl`); :mod:`.logprobs`:
  :func:`token_logprobs`, :func:`entropy_from_logits`, and both straight from the hidden
  states through the LM head a chunk at a time, :func:`head_token_outputs`;
- :mod:`.aggregation`: :func:`aggregate`, which takes *global* normalizers so that
  micro-batch losses summed over gradient accumulation and data-parallel ranks equal
  the full-batch loss; :mod:`.masked`: masked means and whitening.

Adding an estimator is one registered function plus its config (docs/learner.md,
"Adding an estimator").
"""

from asyncrl.learner.algorithms.advantages import (
    compute_advantages,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    token_level_rewards,
)
from asyncrl.learner.algorithms.aggregation import aggregate
from asyncrl.learner.algorithms.corrections import batch_weight_scale, behavior_weights
from asyncrl.learner.algorithms.kl import kl_estimate
from asyncrl.learner.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    batch_kl,
    make_kl_controller,
)
from asyncrl.learner.algorithms.logprobs import (
    entropy_from_logits,
    head_token_outputs,
    token_logprobs,
)
from asyncrl.learner.algorithms.masked import masked_mean, masked_whiten
from asyncrl.learner.algorithms.off_policy import off_policy_metrics
from asyncrl.learner.algorithms.policy_loss import policy_loss
from asyncrl.learner.algorithms.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Needs,
    needs_of,
    register_advantage,
    register_policy_loss,
)
from asyncrl.learner.algorithms.rejection import Criterion, m2po_keep, rejection_keep
from asyncrl.learner.algorithms.surrogates import Surrogate
from asyncrl.learner.algorithms.value import value_loss

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "Criterion",
    "FixedKLController",
    "KLController",
    "Needs",
    "Surrogate",
    "aggregate",
    "batch_kl",
    "batch_weight_scale",
    "behavior_weights",
    "compute_advantages",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "grpo_passk_advantages",
    "head_token_outputs",
    "kl_estimate",
    "m2po_keep",
    "make_kl_controller",
    "masked_mean",
    "masked_whiten",
    "needs_of",
    "off_policy_metrics",
    "policy_loss",
    "register_advantage",
    "register_policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rejection_keep",
    "rloo_advantages",
    "token_level_rewards",
    "token_logprobs",
    "value_loss",
]
