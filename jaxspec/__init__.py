"""jaxspec: speculative decoding in JAX/XLA.

    import jaxspec
    llm = jaxspec.LLM("default", spec="ngram")
    print(llm.generate("The capital of France is", jaxspec.SamplingParams(max_tokens=16))[0].text)

`LLM`, `RequestOutput` and `CompletionOutput` live in `jaxspec.api`,
`SamplingParams` in `jaxspec.sampling_params`; they are imported on first use,
so `import jaxspec` loads no JAX.
"""

__version__ = "0.1.0"

# name -> the module it comes from, imported when first asked for (PEP 562).
_LAZY = {"LLM": "jaxspec.api", "RequestOutput": "jaxspec.api", "CompletionOutput": "jaxspec.api", "Logprob": "jaxspec.api",
         "SamplingParams": "jaxspec.sampling_params", "SamplingError": "jaxspec.sampling_params"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
