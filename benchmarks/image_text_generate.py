"""``kvpass coverage``'s check on image-text-to-text models driven on text alone: every type transformers
maps as image-text-to-text and not as a causal LM (``kvpass coverage`` checks those), or those named.

Each type's row is :func:`kvpass.coverage.check_one`'s, in a subprocess of its own: its default config
shrunk as ``kvpass coverage`` shrinks it, its image-text-to-text model (random weights), a 70-token text
prompt and one decode step compiled with kv4, against the eager model reading the same quantized past;
then ``generate`` through ``model.compile(backend="kv4")``. A type that fails uncompiled (its tiny config,
or a model that needs an image) says so in its status; ``kv4 fails`` and ``wrong logits`` would be
kvpass's to fix.

    python benchmarks/image_text_generate.py [TYPE ...] [--jobs 2] [--timeout 300]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json

from isolated import last_line  # benchmarks/, beside this script


def image_text_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from kvpass.coverage import causal_lm_types

    return sorted(set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - set(causal_lm_types()))


def row(model_type: str, timeout: float) -> str:
    line, why = last_line([__file__, "--one", model_type], timeout, lambda line: line.startswith("{"))
    found = json.loads(line) if line else {"status": "no result", "reason": why}
    error = f"{found['logits_error']:.1e}" if found.get("logits_error") is not None else ""
    ratio = f"{found['bytes_ratio']:.3f}" if found.get("bytes_ratio") is not None else ""
    cells = [model_type, found["status"], found.get("sites", ""), ratio, error, found.get("reason", "")]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every image-text-to-text type no causal LM)")
    parser.add_argument("--jobs", type=int, default=2, help="subprocesses at once")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a type")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a subprocess's type
    args = parser.parse_args()
    if args.one:
        from kvpass.coverage import check_one

        print(json.dumps(check_one(args.one)))
        return
    types = args.types or image_text_types()
    print("| model type | status | sites | bytes | logits error | reason |\n|---|---|---|---|---|---|")
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(lambda t: row(t, args.timeout), types):
            print(line, flush=True)


if __name__ == "__main__":
    main()
