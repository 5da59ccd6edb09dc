"""tokendyn's verl glue against verl itself (0.9.x): the plugin entry point, the registered loss dispatched by
verl's own registry on top of verl's own loss modes, Reweight against the official fork's formula, Lopti's stage
masks against the official semantics written out here, bad options, and the TRL value-head workaround."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from verl.trainer.ppo import core_algos  # verl is in the dev extra: `make test` always runs these
from verl.workers.config.actor import FSDPActorConfig, PolicyLossConfig

from tokendyn.integrations import verl as glue

glue.register()

# verl's loss modes that take plain token advantages (dro needs dro_beta, bypass_mode rollout log-probs)
BASE_MODES = [
    "vanilla",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "cispo",
    "dppo_tv",
    "dppo_kl",
]


def _config(**policy_loss) -> FSDPActorConfig:
    loss = (
        glue.TokendynPolicyLossConfig(**policy_loss)
        if policy_loss.get("loss_mode", glue.LOSS_NAME) == glue.LOSS_NAME
        else PolicyLossConfig(**policy_loss)
    )
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=loss)


def _batch(seed: int = 0, b: int = 4, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(b, t, generator=g).clamp(min=1e-4)).to(
        torch.float32
    )  # pi_old spread over (0, 1)
    logp = old + 0.05 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 5:] = False
    mask[3, 2:] = False
    return old, logp, adv, mask


def _loss_and_w(config, old, logp, adv, mask, agg="token-mean", seed=0):
    """verl's dispatch (`get_policy_loss_fn(config.policy_loss.loss_mode)`, as `ppo_loss` does): the loss, its
    metrics and w = dL/dlog pi per token, by autograd."""
    lp = logp.clone().requires_grad_()
    torch.manual_seed(seed)  # clip_cov picks its tokens with randperm
    fn = core_algos.get_policy_loss_fn(config.policy_loss.loss_mode)
    loss, metrics = fn(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=config,
        rollout_is_weights=None,
    )  # fmt: skip
    (w,) = torch.autograd.grad(loss, lp)
    return loss.detach(), metrics, w


def test_the_plugin_entry_point_registers_the_loss_when_verl_is_imported():
    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("tokendyn") == "tokendyn.integrations.verl_plugin"
    code = (
        "import verl; from verl.trainer.ppo import core_algos as c; "
        "from verl.workers.engine_workers import TrainingWorker as W; "
        "print(c.get_policy_loss_fn('tokendyn').__name__, getattr(W.train_mini_batch, '_tokendyn_wrapped', False), "
        "sorted(k for k in vars(W.train_mini_batch) if k.startswith('attrs_')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    name, wrapped, dispatch = out.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (
        name == "tokendyn_policy_loss" and wrapped == "True"
    )  # the loss, and the actor worker's update wrapped
    assert dispatch.startswith(
        "['attrs_"
    )  # verl's dispatch attributes kept on the wrapper (the worker group's)


@pytest.mark.parametrize("mode", BASE_MODES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_alpha_zero_on_all_tokens_is_the_base_loss_bitwise(mode, agg):
    old, logp, adv, mask = _batch()
    base = _loss_and_w(_config(loss_mode=mode), old, logp, adv, mask, agg)
    ours = _loss_and_w(_config(base_loss_mode=mode), old, logp, adv, mask, agg)
    assert torch.equal(base[0], ours[0]) and torch.equal(base[2], ours[2])
    assert {k: v for k, v in ours[1].items() if not k.startswith("actor/tokendyn/")} == base[1]
    assert ours[1]["actor/tokendyn/stage_token_share"] == 1.0


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo"])
def test_reweight_is_the_official_formula_under_any_base_loss(mode):
    """The official fork multiplies the advantages by (k exp(old_log_probs) + tau), k = alpha, tau = 1 - alpha."""
    alpha = 0.3
    old, logp, adv, mask = _batch(seed=1)
    by_hand = adv * (alpha * torch.exp(old) + (1 - alpha))
    ref = _loss_and_w(_config(loss_mode=mode), old, logp, by_hand, mask)
    ours = _loss_and_w(_config(base_loss_mode=mode, reweight_alpha=alpha), old, logp, adv, mask)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-6, atol=1e-12)


def test_lopti_stages_keep_their_group_and_the_whole_denominator():
    """Official semantics: stage low keeps the advantages of pi_old < eta, high those of pi_old >= eta, the response
    mask (the token-mean denominator) unchanged. With a loss that is a sum of per-token terms over one denominator,
    the two stages' w then add up to the full update's w, token by token."""
    eta = 0.5
    old, logp, adv, mask = _batch(seed=2)
    full = _loss_and_w(_config(reweight_alpha=0.2), old, logp, adv, mask)
    low = _loss_and_w(_config(reweight_alpha=0.2, lopti_eta=eta, lopti_stage="low"), old, logp, adv, mask)
    high = _loss_and_w(_config(reweight_alpha=0.2, lopti_eta=eta, lopti_stage="high"), old, logp, adv, mask)
    below = mask & (torch.exp(old) < eta)
    above = mask & (torch.exp(old) >= eta)
    assert torch.count_nonzero(low[2][~below]) == 0 and torch.count_nonzero(high[2][~above]) == 0
    torch.testing.assert_close(low[2] + high[2], full[2], rtol=1e-6, atol=1e-12)
    n = int(mask.sum())
    assert low[1]["actor/tokendyn/stage_token_share"] == pytest.approx(int(below.sum()) / n)
    assert high[1]["actor/tokendyn/stage_token_share"] == pytest.approx(int(above.sum()) / n)


def test_the_stage_is_the_one_mutable_option():
    cfg = glue.TokendynPolicyLossConfig(lopti_eta=0.5)
    cfg.lopti_stage = "low"  # the trainer's to set between its two updates
    with pytest.raises(Exception, match="frozen"):
        cfg.reweight_alpha = 0.5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"base_loss_mode": "nope"}, "policy_loss.base_loss_mode: must be a registered verl loss other than"),
        (
            {"base_loss_mode": "tokendyn"},
            "policy_loss.base_loss_mode: must be a registered verl loss other than",
        ),
        ({"reweight_alpha": 1.5}, r"policy_loss.reweight_alpha: must be a number in \[0, 1\], got 1.5"),
        ({"reweight_alpha": True}, r"policy_loss.reweight_alpha: must be a number in \[0, 1\], got True"),
        ({"lopti_eta": 1.0}, r"policy_loss.lopti_eta: must be a number in \(0, 1\), got 1.0"),
        ({"lopti_stage": "middle"}, "policy_loss.lopti_stage: must be one of all, low, high, got 'middle'"),
        ({"lopti_stage": "low"}, r"policy_loss.lopti_stage: 'low' needs a threshold \(policy_loss.lopti_eta"),
        ({"lopti_quantile": 0.0}, r"policy_loss.lopti_quantile: must be a number in \(0, 1\), got 0.0"),
        (
            {"lopti_order": "middle"},
            "policy_loss.lopti_order: must be one of low_first, high_first, got 'middle'",
        ),
        ({"probe_dir": ""}, "policy_loss.probe_dir: must be a directory path or None, got ''"),
        ({"probe_options": {"binz": 4}}, "policy_loss.probe_options.binz: not a probe option"),
        (
            {"probe_options": {"sample_tokens": -1}},
            "policy_loss.probe_options.sample_tokens: must be an integer",
        ),
        ({"probe_analyses_every": -1}, "policy_loss.probe_analyses_every: must be an integer >= 0"),
    ],
)
def test_bad_options_fail_in_one_line_naming_the_field(options, message):
    with pytest.raises(glue.VerlConfigError, match=message) as err:
        glue.TokendynPolicyLossConfig(**options)
    assert "\n" not in str(err.value)


def test_verl_engine_builds_beside_trl_with_the_value_head_workaround():
    """verl patches TRL's AutoModelForCausalLMWithValueHead whenever TRL is importable; TRL 1.16 has none. If either
    side changes (TRL brings the class back, verl stops asking), this test says so."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.models.transformers import monkey_patch
    from verl.utils.import_utils import is_trl_available

    assert is_trl_available()  # TRL is here (tokendyn's trainer needs it) ...
    with pytest.raises(ImportError):
        from trl import AutoModelForCausalLMWithValueHead  # noqa: F401  ... without the class verl patches
    model = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
    )  # fmt: skip
    monkey_patch.is_trl_available = is_trl_available  # verl as it ships
    try:
        with pytest.raises(ImportError, match="AutoModelForCausalLMWithValueHead"):
            monkey_patch.apply_monkey_patch(model, use_remove_padding=True)
    finally:
        glue.disable_trl_value_head_patch()
    monkey_patch.apply_monkey_patch(model, use_remove_padding=True)
    assert monkey_patch.is_trl_available() is False


def test_the_documented_overrides_compose_with_verls_own_trainer_config():
    """The overrides docs/verl.md gives a `main_ppo` run (and the README repeats, line for line), read from the docs
    themselves, composed with verl's own `ppo_trainer` config by Hydra and turned into verl's actor config:
    tokendyn's policy-loss class with every field as written."""
    import os
    import re
    from pathlib import Path

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    root = Path(__file__).parents[1]
    blocks = {
        doc: [b for b in re.findall(r"```bash\n(.*?)```", (root / doc).read_text(), re.S) if "main_ppo" in b]
        for doc in ("docs/verl.md", "README.md")
    }
    assert all(len(found) == 1 for found in blocks.values()), {
        doc: len(found) for doc, found in blocks.items()
    }
    block = blocks["docs/verl.md"][0]
    assert blocks["README.md"][0] == block  # the README's example is the verl guide's, line for line
    overrides = re.findall(r"^\s+(\+?actor_rollout_ref\.\S+)", block, flags=re.M)
    assert len(overrides) >= 8
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[*overrides, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
        )
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    loss = actor.policy_loss
    assert type(loss) is glue.TokendynPolicyLossConfig and loss.loss_mode == glue.LOSS_NAME
    pairs = (o.lstrip("+").split("=", 1) for o in overrides if "probe_options" not in o)
    written = {key.rsplit(".", 1)[1]: value for key, value in pairs}
    assert loss.reweight_alpha == float(written["reweight_alpha"]) and loss.lopti_eta == float(
        written["lopti_eta"]
    )
    assert loss.probe_dir == written["probe_dir"] and loss.probe_analyses_every == int(
        written["probe_analyses_every"]
    )
    assert loss.probe_config().bins == "intervals:4" and loss.base_loss_mode == written["base_loss_mode"]
