"""vLLM's and llama-server's flags that kvtier has no equivalent for: each is refused before argparse
runs with one line saying so and what to use instead, where argparse would only say "unrecognized
arguments". (Their flags that mean what one of kvtier's does are aliases of it: `option(aliases=...)`
in kvtier/cli/engine_args.py and kvtier/cli/serve.py.)"""

from __future__ import annotations

from collections.abc import Sequence

REFUSED: dict[tuple[str, ...], str] = {
    ("-tp", "--tensor-parallel-size"): "no tensor parallelism: kvtier runs the whole model on one device (--device)",
    ("-ngl", "--n-gpu-layers", "--gpu-layers"): "the whole model runs on --device (cuda: every layer on the GPU)",
    ("--trust-remote-code",): "kvtier runs only the architectures it implements (docs/models.md), never a model's "
                              "own code",
    ("--chat-template",): "kvtier always renders the model's own chat template; /v1/completions and generate --raw "
                          "send a prompt as is",
    ("--jinja",): "kvtier always renders the model's own (Jinja) chat template: drop the flag",
    ("--tokenizer",): "kvtier uses the tokenizer that comes with --model (its directory, Hub repo or GGUF)",
    ("--generation-config",): "kvtier does not read generation_config.json: send sampling parameters with each "
                              "request",
    ("--enable-auto-tool-choice", "--tool-call-parser"): "tool calls are on by default; the call format is picked "
                                                         "from the model's chat template",
}
_BY_FLAG = {flag: why for flags, why in REFUSED.items() for flag in flags}


def refusal(argv: Sequence[str]) -> str | None:
    """The one-line error for the first such flag on the command line (`--flag` or `--flag=value`;
    nothing after a `--`), else None."""
    for arg in argv:
        if arg == "--":
            break
        flag = arg.split("=", 1)[0] if arg.startswith("--") else arg
        if flag in _BY_FLAG:
            return f"{flag}: kvtier has no such option; {_BY_FLAG[flag]}"
    return None
