"""The sampling defaults a model's authors recommend (its generation_config.json), for requests that leave a field
unset, as vLLM's `--generation-config auto` applies them: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as the default max_tokens. Only what the file sets apart from transformers' own defaults counts, so a
file that sets nothing (the embedded model's) changes nothing."""
from __future__ import annotations

import logging
from typing import Any, get_args

from engine.config import EngineConfig, SamplingDefault
from engine.errors import EngineInputError
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

GENERATION_CONFIG_NAMES = get_args(SamplingDefault)
# the SamplingParams (and OpenAI request) fields a default may fill; max_tokens is InputProcessor's to choose
SAMPLING_DEFAULTS = frozenset(GENERATION_CONFIG_NAMES) - {"max_new_tokens"}


def sampling_defaults(generation_config: Any, config: EngineConfig) -> dict[str, float]:
    """Each default by SamplingParams' name (max_new_tokens as max_tokens): the model's unless config says vllm,
    with config's overrides over them. One SamplingParams refuses is left out, with a warning: the file advises."""
    read = generation_config is not None and config.generation_config == "auto"
    given = generation_config.to_diff_dict() if read else {}
    defaults = {name: given[name] for name in GENERATION_CONFIG_NAMES if given.get(name) is not None}
    defaults.update(config.override_generation_config)
    if defaults.get("top_k") == 0:
        defaults["top_k"] = -1  # transformers' "off"
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    for name, value in list(defaults.items()):
        try:
            SamplingParams(**({"max_tokens": int(value)} if name == "max_tokens" else as_params({name: value})))
        except EngineInputError as exc:
            log.warning("the generation config's %s is left out: %s", name, exc)
            del defaults[name]
    if defaults:
        log.info("requests that leave them unset sample with the model's defaults %s (generation_config: vllm turns "
                 "them off)", defaults)
    return defaults


def as_params(defaults: dict[str, float]) -> dict[str, float | int]:
    """The sampling defaults as SamplingParams' keyword arguments. max_tokens is not one: a request without it
    gets the model's default where InputProcessor chooses max_tokens, under the server's limit."""
    return {name: int(value) if name == "top_k" else value for name, value in defaults.items() if name != "max_tokens"}
