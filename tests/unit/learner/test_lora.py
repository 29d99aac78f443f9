"""``model.lora``: a single-rank learner (FSDP2 over a process group of one) trains only
peft's adapters, publishes them alone (an engine applying them computes the learner's
policy, and reads back the digest the learner announces) or plain Hugging Face weights
with the adapters folded in,
checkpoints the adapters alone and resumes bit for bit, and exports a merged folder and
an adapter that peft loads."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from asyncrl.config import load_config
from asyncrl.generation import lora
from asyncrl.generation.models import build_policy
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.learner import checkpoint, sharding
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.policy import Learner
from tests.helpers.learner import TINY_LEARNER, synthetic_batch

peft = pytest.importorskip("peft")

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "learner.lr=0.05"]


def make_learner(ranks: Ranks, *overrides: str) -> Learner:
    config = load_config(None, [*TINY_LEARNER, *LORA, *overrides])
    torch.manual_seed(config.run.seed)
    return Learner(config, ranks)


def batch_at(step: int):
    return synthetic_batch(step, len(build_tokenizer()))


def trained(learner: Learner, steps: range) -> Learner:
    for step in steps:
        learner.train_step(batch_at(step))
    return learner


def optimized_names(learner: Learner) -> list[str]:
    """The names of the parameters the optimizer holds (the root resharded first: after
    a forward alone, FSDP2 leaves its root's parameters unsharded, other objects)."""
    learner.model.reshard()
    names = {id(p): n for n, p in learner.model.named_parameters()}
    return [names[id(p)] for group in learner.optimizer.param_groups for p in group["params"]]


def peft_state(learner: Learner) -> dict[str, torch.Tensor]:
    """The wrapped model's full tensors by peft's names (prefix stripped)."""
    return dict(sharding.full_tensors(learner.model, learner.publish_prefix))


def test_only_the_adapters_train_and_the_base_stays_as_loaded(ranks: Ranks):
    learner = make_learner(ranks)
    optimized = optimized_names(learner)
    assert optimized and all(lora.is_adapter(name) for name in optimized)
    base = {n: t for n, t in peft_state(learner).items() if not lora.is_adapter(n)}
    published = dict(learner.full_tensors())
    trained(learner, range(2))
    assert all(torch.equal(t, peft_state(learner)[n]) for n, t in base.items())
    after = dict(learner.full_tensors())
    moved = {n for n in published if not torch.equal(published[n], after[n])}
    assert "model.layers.0.self_attn.q_proj.weight" in moved  # an adapted layer
    assert not {n for n in moved if "norm" in n or "embed" in n}  # no adapter there


MERGED = "model.lora.publish=merged"


def test_published_weights_are_peft_s_own_merge_under_the_plain_model_s_names(ranks: Ranks):
    learner = trained(make_learner(ranks, MERGED), range(2))
    published = dict(learner.published_tensors())
    plain = build_policy(learner.config.model, learner.config.run.seed)[0]
    skipped = learner.tied_head
    assert set(published) == set(plain.state_dict()) - skipped
    wrapped = lora.with_adapters(plain, learner.lora, seed=123)
    state = {f"{lora.PEFT_PREFIX}{n}": t for n, t in peft_state(learner).items()}
    wrapped.load_state_dict(state)
    merged = wrapped.merge_and_unload().state_dict()
    for name, tensor in published.items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6, msg=name)


def test_fresh_adapters_publish_the_base_model_exactly(ranks: Ranks):
    learner = make_learner(ranks, MERGED)
    plain = build_policy(learner.config.model, learner.config.run.seed)[0].state_dict()
    for name, tensor in learner.published_tensors():
        assert torch.equal(tensor, plain[name]), name  # B starts at zero


def test_a_checkpoint_holds_only_the_adapters_and_resumes_bit_for_bit(ranks: Ranks, tmp_path):
    learner = trained(make_learner(ranks), range(2))
    assert learner.save_checkpoint(tmp_path / "step-2")
    checkpoint.mark_complete(tmp_path / "step-2")
    saved = FileSystemReader(tmp_path / "step-2").read_metadata().state_dict_metadata
    weights = [key for key in saved if key.startswith("model.")]
    assert weights and all(lora.is_adapter(key) for key in weights), weights[:3]
    unbroken = dict(trained(learner, range(2, 4)).full_tensors())
    resumed = make_learner(ranks)
    resumed.load_checkpoint(tmp_path / "step-2")
    assert resumed.version == 2
    for name, tensor in trained(resumed, range(2, 4)).full_tensors():
        assert torch.equal(tensor, unbroken[name]), name


def test_the_export_is_a_merged_folder_and_an_adapter_peft_loads(ranks: Ranks, tmp_path):
    from transformers import AutoModelForCausalLM

    learner = trained(make_learner(ranks), range(2))
    learner.save_pretrained(tmp_path / "final")
    inputs = batch_at(9).input_ids[:4]
    with torch.no_grad():
        expected = learner.model(input_ids=inputs).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
        torch.testing.assert_close(merged(input_ids=inputs).logits, expected)
        base = build_policy(learner.config.model, learner.config.run.seed)[0]
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "final" / lora.ADAPTER_DIR)
        torch.testing.assert_close(adapted.eval()(input_ids=inputs).logits, expected)


def test_ppo_trains_the_value_head_beside_the_adapters(ranks: Ranks):
    learner = make_learner(ranks, "algorithm.advantage=gae")
    optimized = optimized_names(learner)
    assert "value_head.weight" in optimized
    assert all(lora.is_adapter(n) or n.startswith("value_head.") for n in optimized)
    assert "value_head.weight" not in dict(learner.published_tensors())
    trained(learner, range(1))


@pytest.mark.parametrize(
    ("targets", "problem"),
    [("[embed_tokens]", "not linear layers"), ("[no_such_proj]", "no_such_proj")],
)
def test_targets_that_cannot_take_an_adapter_are_named(ranks: Ranks, targets: str, problem: str):
    with pytest.raises(ValueError, match=problem):
        make_learner(ranks, f"model.lora.target_modules={targets}")


def test_without_peft_the_error_says_what_to_install(ranks: Ranks, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(lora.LoraUnavailable, match=r"asyncrl\[lora\]"):
        make_learner(ranks)


def test_kl_s_reference_is_the_policy_with_its_adapters_off(ranks: Ranks):
    """No second copy of the base: the reference log-probs are the base model's, while
    the policy's own have moved with its adapters."""
    kl = ["algorithm.kl_coef=0.1", "learner.minibatches=2"]  # two updates: a proximal pass
    learner = trained(make_learner(ranks, *kl), range(2))
    assert learner.reference.model is learner.model
    batch = batch_at(5)
    pre = learner.proximal_logprobs(batch)
    config = load_config(None, [*TINY_LEARNER, *kl])
    torch.manual_seed(config.run.seed)
    base = Learner(config, ranks).proximal_logprobs(batch)["proximal"]  # full weights, v0
    torch.testing.assert_close(pre["reference"], base, rtol=0, atol=1e-5)
    assert not torch.allclose(pre["proximal"], pre["reference"], atol=1e-3)


def test_published_adapters_applied_by_the_hf_engine_compute_the_learner_s_policy(
    ranks: Ranks,
):
    from asyncrl.generators.hf_backend import HFBackend

    learner = trained(make_learner(ranks), range(2))
    published = list(learner.published_tensors())
    names = {name for name, _ in published}
    assert names and all(lora.is_adapter(name) and ".default." not in name for name in names)
    adapted = {name.split(".lora_")[0] for name in names}
    assert "model.layers.0.self_attn.q_proj" in adapted
    plain, tokenizer = build_policy(learner.config.model, learner.config.run.seed)
    engine = HFBackend(plain, tokenizer, learner.config.generators, adapters=learner.lora)
    assert engine.adapter_digest == lora.BASE_DIGEST  # zero adapters: the base model
    # what every weight path checks a version against: the adapters' layout, nothing else
    from asyncrl.weights.checks import engine_layout

    assert set(engine_layout(engine).specs) == names
    engine.load_weights(dict(published), version=2)
    digest = lora.adapter_digest(published)
    assert engine.version == 2 and engine.adapter_digest == digest != lora.BASE_DIGEST
    tokens = torch.arange(3, 19)[None]
    learner.model.eval()
    with torch.no_grad():
        ours = learner.model(input_ids=tokens).logits
        theirs = engine.model(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_an_adapter_s_digest_names_its_values_and_zero_b_is_the_base():
    a, b = torch.ones(2, 3), torch.zeros(3, 2)
    assert lora.adapter_digest([("x.lora_A.weight", a), ("x.lora_B.weight", b)]) == "base"
    b[0, 0] = 1e-6
    one = lora.adapter_digest([("x.lora_A.weight", a), ("x.lora_B.weight", b)])
    assert one == lora.adapter_digest([("x.lora_B.weight", b), ("x.lora_A.weight", a)])
    a[1, 2] = 1.0 + 2**-20  # one value one ulp-ish away
    assert lora.adapter_digest([("x.lora_A.weight", a), ("x.lora_B.weight", b)]) != one
