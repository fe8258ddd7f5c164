"""Structured output on the host: llguidance matchers over the model's tokenizer (`matcher`).
The request-side type is `jaxspec.sampling_params.StructuredOutputs`; the device side is
`jaxspec.speculative.grammar`."""
