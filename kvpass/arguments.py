"""argparse types shared by the subcommands: a bad count is refused while parsing, naming the value
and what is accepted, instead of failing later inside a run (``--chunk 0``) or running nonsense
(``--contexts -5``)."""

from __future__ import annotations

import argparse
import ast
import math
from typing import Any

_SUFFIXES = {"k": 2**10, "m": 2**20}

# What --model takes wherever a real model is loaded (kvpass.models_zoo.real_model.load_model).
REAL_MODELS = ("smollm2, a .gguf file, a directory written by save_pretrained, or a hub id (org/name) in the local "
               "Hugging Face cache")


def positive_int(text: str) -> int:
    """``'8'`` -> 8; zero, negatives and non-integers are refused."""
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """``'0'`` -> 0: a count that may be zero (warm-up steps, tokens decoded after a fill)."""
    return _int_at_least(text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """``'150'`` -> 150.0 (seconds, say); zero, negatives and NaN are refused."""
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """``'0.25'`` -> 0.25 (a threshold in percent, which may be zero); negatives, infinities and NaN are refused."""
    value = _float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def tokens(text: str) -> int:
    """A token count, optionally with a K (x1024) or M (x1024**2) suffix: ``'128K'`` -> 131072."""
    scale = _SUFFIXES.get(text[-1:].lower(), 1)
    try:
        value = int(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count like 4096 or 128K, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive token count, got {text!r}")
    return value


def token_list(text: str) -> list[int]:
    """Comma-separated token counts: ``'512,2K'`` -> ``[512, 2048]``."""
    return _listed(text, tokens, "token counts such as 512,2048")


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers: ``'1,4'`` -> ``[1, 4]``."""
    return _listed(text, positive_int, "positive integers such as 1,4")


def comma_list(parse, what: str):
    """An argparse type for comma-separated items, each read by ``parse``, whose ValueError becomes
    argparse's message (``--methods fp,kv5``: "argument --methods: unknown method 'kv5' ...")."""

    def item(text: str):
        try:
            return parse(text)
        except ValueError as err:  # named, so one bad item of several is found
            raise argparse.ArgumentTypeError(str(err) if text in str(err) else f"{text!r}: {err}") from None

    return lambda text: _listed(text, item, what)


def one_of(known, what: str):
    """A ``parse`` for :func:`comma_list` that takes only the names in ``known``."""

    def name(text: str) -> str:
        if text not in known:
            raise ValueError(f"unknown {what} {text!r}; use some of {list(known)}")
        return text

    return name


def add_kv4_settings(parser: argparse.ArgumentParser, what: str, taken: tuple[str, ...] = ()) -> None:
    """``--kv4-setting NAME=VALUE``, repeatable, into ``args.kv4_settings``: ``kvpass.kv4`` keywords for ``what``;
    the help's examples leave out those ``taken`` by the command's own options."""
    examples = [text for name, text in _KV4_EXAMPLES.items() if name not in taken]
    parser.add_argument("--kv4-setting", dest="kv4_settings", type=kv4_setting, action="append", default=[],
                        metavar="NAME=VALUE", help=f"a kvpass.kv4 keyword argument for {what}, e.g. "
                        f"{', '.join(examples[:-1])} or {examples[-1]} (repeatable)")  # fmt: skip


_KV4_EXAMPLES = {"bits": "bits=8", "k_defer_prefix": "k_defer_prefix=False", "k_layer_bits": "'k_layer_bits={8: 8}'"}


def kv4_settings_text(settings: list[tuple[str, Any]]) -> str:
    """``[('bits', 8)]`` -> ``'bits=8'``: settings as the keywords of a ``kvpass.kv4`` call."""
    return ", ".join(f"{name}={value!r}" for name, value in settings)


def kv4_settings_as_literals(settings: dict) -> dict[str, str]:
    """``settings`` with each value as its Python literal, for a subprocess's JSON (which would turn
    ``k_layer_bits``' layer numbers into strings); :func:`kv4_settings_from_literals` reads them back."""
    return {name: repr(value) for name, value in settings.items()}


def kv4_settings_from_literals(literals: dict[str, str]) -> dict:
    return {name: ast.literal_eval(text) for name, text in literals.items()}


def kv4_setting(text: str) -> tuple[str, Any]:
    """``'k_prefix_tokens=512'`` -> ``('k_prefix_tokens', 512)``, a keyword argument of ``kvpass.kv4``
    and its value (a Python literal, else the text itself); the name is checked where it is used."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE such as k_prefix_tokens=512, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def _float(text: str) -> float:
    """``float(text)``, or NaN where the text is no number (which every check refuses)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def _int_at_least(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _listed(text: str, item, what: str) -> list:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
    return [item(part) for part in parts]
