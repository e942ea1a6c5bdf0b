"""A/B arms made runnable: the gates an arm names (an adapter loaded, or fresh ones), and its policy at a budget.

``eval.config`` validates a config with these before the model loads (adapters present and readable; parameters
accepted at every budget); ``prepare_arms`` checks the rest against the loaded model and ``eval.runner`` runs
the policies ``build_policy`` makes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import kvgates
from kvgates.errors import AdapterError, ConfigError
from kvgates.gates import GATE_KINDS
from kvgates.gates.embedded import embedded_adapter_dir, embedded_adapters
from kvgates.policies.wrappers import learned_params, with_gates

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from eval.config import ABConfig, ArmSpec

#: Gates of an arm built fresh for the model (``gates: untrained``), as the training issue initialises them.
UNTRAINED = "untrained"
UNTRAINED_GATES = {"gate_hidden": 64, "init_bias": 8.0}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def load_adapter(arm: ArmSpec, adapters: dict[str, kvgates.GateSet]) -> kvgates.GateSet:
    """The adapter ``arm`` names (a folder, a shipped adapter's name, else a Hub id), or ``ConfigError`` saying why
    it cannot be read. It is read once per run: ``adapters`` (the run's ``ABConfig.adapters``) keeps it by what the
    arm names, for every later use and every other arm naming it."""
    path_or_id, label = arm.gates, arm.label
    if path_or_id in adapters:
        return adapters[path_or_id]
    if not Path(path_or_id).is_dir() and embedded_adapter_dir(path_or_id) is None and not HUB_ID.fullmatch(path_or_id):
        raise ConfigError(
            f"arm {label!r}: the adapter {path_or_id} is neither an existing folder, a shipped adapter "
            f"({', '.join(embedded_adapters()) or 'none ship'}) nor a Hub id (owner/name)"
        )
    try:
        adapters[path_or_id] = kvgates.load_gates(path_or_id)
    except AdapterError as err:
        raise ConfigError(f"arm {label!r}: {' '.join(str(err).split())}") from None
    return adapters[path_or_id]


def build_policy(arm: ArmSpec, budget: int | None, gates: kvgates.GateSet | None = None) -> kvgates.Policy:
    """The arm's policy at ``budget`` (learned arms: with ``gates``, given to the base when the policy wraps one)."""
    params = with_gates(arm.policy, arm.params, gates) if arm.learned else dict(arm.params)
    return kvgates.make_policy(arm.policy, **params) if not arm.budgeted else kvgates.make_policy(arm.policy, budget=budget, **params)


def check_budgets(arm: ArmSpec, budgets: tuple[int | None, ...], gates: kvgates.GateSet | None = None) -> None:
    """Build the arm's policy at each of ``budgets``: ``ConfigError`` for parameters it refuses at one of them."""
    for budget in budgets:
        try:
            build_policy(arm, budget, gates)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"arm {arm.label!r} at budget {budget}: {err}") from None


def prepare_arms(config: ABConfig, model: PreTrainedModel) -> dict[str, kvgates.GateSet | None]:
    """Gates of every arm, checked against ``model`` and built into each arm's policy at every budget.

    Adapters made for another model and bad parameters of learned arms raise ``ConfigError`` here, before any
    example runs; adapters ``ABConfig.validate`` read are not read again. Untrained gates are initialised from the
    run's seed (``UNTRAINED_GATES``).
    """
    gates: dict[str, kvgates.GateSet | None] = {}
    for arm in config.all_arms:
        g = None
        if arm.learned:
            if arm.gates == UNTRAINED:
                kind = arm.learned_policy.gate_kinds[0]
                torch.manual_seed(config.seed)
                g = GATE_KINDS[kind].for_model(model, **UNTRAINED_GATES)
            else:
                g = load_adapter(arm, config.adapters)
                learned = learned_params(arm.policy, arm.params)  # a wrapper's base_params: strict is the base's
                try:
                    g.check_model(model, strict=learned.get("strict", True))
                except AdapterError as err:
                    where = "params" if learned is arm.params else "base_params"
                    strict = f"add strict: false to the arm's {where}"
                    raise ConfigError(f"arm {arm.label!r}: {str(err).replace('pass strict=False', strict)}") from None
        check_budgets(arm, config.arm_budgets(arm), g)
        gates[arm.label] = g
    return gates
