"""Choosing the reward function: built-in scorers by `data_source`, or a user function from a file.

Every reward function has veRL's signature:

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float

`kwargs` carries optional overrides such as `format_score` (the reward manager passes it only when configured).
The built-in scorers read the row's reward style ("rule" or "natural", see mppo.rewards.answer) from
`extra_info["reward_style"]`, where RLDataset puts a row's `reward_model.style` when it is not "rule".
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from mppo.errors import UserError
from mppo.rewards import countdown, gsm8k, multiply
from mppo.rewards.answer import REWARD_STYLES

ComputeScore = Callable[..., Any]

# data_source (the parquet column) → scorer(solution_str, ground_truth, **kwargs).
SCORERS: dict[str, Callable[..., float]] = {
    "countdown": countdown.compute_score,
    "multiply": multiply.compute_score,
    "gsm8k": gsm8k.compute_score,
    "openai/gsm8k": gsm8k.compute_score,  # the data_source veRL's GSM8K preprocessing writes
}


class RewardConfigError(UserError, ValueError):
    """The reward setup (a data source, a custom function path or name) cannot be used."""


def known_data_sources() -> list[str]:
    return sorted(SCORERS)


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                          **kwargs: Any) -> float:
    """Score one sample with the built-in scorer for `data_source`; unknown sources raise RewardConfigError."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise RewardConfigError(
            f"no built-in reward for data_source {data_source!r}; known data sources: {known_data_sources()}. "
            "Set reward.custom_fn.path and reward.custom_fn.name to score other data.")
    style = (extra_info or {}).get("reward_style", "rule") if isinstance(extra_info, dict) else "rule"
    if style not in REWARD_STYLES:
        raise RewardConfigError(f"unknown reward style {style!r} for data_source {data_source!r} "
                                f"(reward_model.style); built-in scorers know {REWARD_STYLES}")
    if style != "rule":
        kwargs["style"] = style
    return float(scorer(solution_str, ground_truth, **kwargs))


def load_custom_reward_fn(path: str | os.PathLike[str], name: str) -> ComputeScore:
    """Import the Python file at `path` and return its function `name`.

    The file is the user's own configured code (never model output): it is imported, not evaluated as text.
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isfile(path):
        raise RewardConfigError(f"reward.custom_fn.path {path!r} does not exist or is not a file; point it at a "
                                ".py file that defines your reward function")
    if not path.endswith(".py"):
        raise RewardConfigError(f"reward.custom_fn.path {path!r} is not a .py file")
    module_name = "mppo_custom_reward_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardConfigError(f"cannot import reward.custom_fn.path {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise RewardConfigError(f"importing reward.custom_fn.path {path!r} failed: "
                                f"{type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardConfigError(f"{path!r} has no attribute {name!r} (reward.custom_fn.name); "
                                f"callables defined there: {defined}")
    if not callable(fn):
        raise RewardConfigError(f"{path}:{name} is a {type(fn).__name__}, not a function")
    return fn


def resolve_compute_score(custom_fn_path: str | None = None, custom_fn_name: str | None = None) -> ComputeScore:
    """The configured reward function: the user's when `custom_fn_path` is set, else `default_compute_score`.

    The path decides (the name has a default, `compute_score`, in the config); a path without a name is an error.
    """
    if not custom_fn_path:  # None or "" (unset)
        return default_compute_score
    if not custom_fn_name:
        raise RewardConfigError(f"reward.custom_fn.path is {custom_fn_path!r} but reward.custom_fn.name is empty; "
                                "set it to the function's name in that file")
    return load_custom_reward_fn(custom_fn_path, custom_fn_name)
