"""`python -m minisgl serve | generate`."""

from __future__ import annotations

import argparse
import logging
import sys

from minisgl.args import ServerArgs


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """A bad flag: one line and exit code 2 (argparse would print the usage too)."""
        self.exit(2, f"error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m minisgl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="Run the HTTP server (SGLang and OpenAI APIs).")
    ServerArgs.add_cli_args(serve)
    gen = commands.add_parser("generate", help="Generate one completion and print it.")
    gen.add_argument("--prompt", required=True, help="The prompt text.")
    gen.add_argument("--chat", action="store_true", help="Wrap the prompt in the chat template.")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None, help="Seed of this sample.")
    ServerArgs.add_cli_args(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args = ServerArgs.from_cli(ns)
        if ns.command == "serve":
            from minisgl.server.serve import serve
            serve(args)
            return 0
        return _generate(ns, args)
    except (ValueError, FileNotFoundError) as exc:  # bad flags, missing model: one clear line
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _generate(ns: argparse.Namespace, args: ServerArgs) -> int:
    import dataclasses

    from minisgl.llm import LLM

    llm = LLM(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)
                 if f.name not in ("model_path", "dtype")},
              model=args.model_path, dtype=args.dtype)
    try:
        prompt = ns.prompt
        if ns.chat:
            prompt = llm.runtime.tokenizer.chat_prompt([{"role": "user", "content": prompt}])
        params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature,
                  "top_p": ns.top_p, "top_k": ns.top_k, "sampling_seed": ns.sampling_seed}
        out = llm.generate(prompt=prompt, sampling_params=params)
        print(out["text"])
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
