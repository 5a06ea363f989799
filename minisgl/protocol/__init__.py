"""Between the runtime and the front ends: SGLang-native and OpenAI request bodies in (parsing,
the field policy, shape checks), results out (JSON bodies, stream chunk objects, logprob
layouts). No HTTP here: the server reads bodies and writes responses, the offline `LLM` calls
the same parsers and shapers."""
