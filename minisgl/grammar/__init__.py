"""Grammar-constrained decoding: compiling a request's JSON schema, regex or EBNF into a
grammar (xgrammar), and the per-request matcher that says which tokens may come next.

The scheduler only sees the matcher's three methods (accept_token, fill_next_token_bitmask,
is_terminated) and fills a plain int32 bitmask; the sampler applies it with torch ops. Nothing
below this package imports xgrammar.
"""

from minisgl.grammar.backend import GrammarBackend, builtin_structural_tag, create_grammar_backend

__all__ = ["GrammarBackend", "builtin_structural_tag", "create_grammar_backend"]
