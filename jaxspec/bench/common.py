"""Shared benchmark pieces: prompts, bandwidth measurement, Hugging Face and llama.cpp peers, tables."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

# Chat prompts for decode benchmarks; EOS is ignored, so their length only
# sets the prefix. Eight, so batch 8 uses each once.
CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the ocean.",
    "Explain what a hash table is in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for writing clear technical documentation.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What are the main differences between TCP and UDP?",
    "Describe how photosynthesis works to a ten-year-old.",
]


def chat_ids(tokenizer, texts: Sequence[str], system: str | None = None) -> list[list[int]]:
    out = []
    head = [{"role": "system", "content": system}] if system is not None else []
    for text in texts:
        ids = tokenizer.apply_chat_template(
            head + [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure_single_thread_bandwidth(num_bytes: int = 1 << 30, reps: int = 7) -> float:
    """The old roofline figure: best of a numpy and an XLA streaming sum, bytes/s (median).
    numpy sums on one thread and XLA only sometimes splits the reduce across threads,
    so it understates the peak, and by a varying amount: kept only to print beside
    the multi-threaded native figure."""
    import jax
    import jax.numpy as jnp

    a = np.ones(num_bytes // 4, np.float32)
    np_times = timed(a.sum, reps)
    x = jnp.asarray(a)
    f = jax.jit(lambda v: jnp.sum(v))
    f(x).block_until_ready()
    jx_times = timed(lambda: f(x).block_until_ready(), reps)
    return num_bytes / min(median(np_times), median(jx_times))


@dataclasses.dataclass
class Bandwidth:
    """Read bandwidths for the roofline, bytes/s. `multi` is NaN when the native kernel
    could not be built (`note` says why); the roofline then falls back to `single`."""

    single: float  # best of the numpy and XLA sums (the old figure); NaN when not measured
    multi: float  # native streaming read on every core (jaxspec/native/bandwidth.cc)
    threads: int = 0
    note: str = ""

    @property
    def roofline(self) -> float:
        return self.multi if self.multi == self.multi else self.single

    def header(self) -> str:
        single = f"{self.single / 1e9:.1f} GB/s numpy/XLA sum (old figure, numpy on one thread)"
        if self.multi == self.multi:
            return (f"read bandwidth {self.multi / 1e9:.1f} GB/s multi-threaded native read "
                    f"({self.threads} threads, huge pages; the roofline uses it), {single}")
        return f"read bandwidth {single}: the roofline uses it; {self.note}"


def native_read_bandwidth(passes: int = 10, rounds: int = 5, pause_s: float = 0.2) -> Bandwidth:
    """The multi-threaded native figure alone: the best of `rounds` rounds of `passes`
    passes, `pause_s` apart (on a shared 2-core VM a round now and then reads ~60% of
    the peak, for a while); NaN plus a note when the kernel is unavailable."""
    from jaxspec.native import bandwidth
    from jaxspec.native.build import NativeKernelError

    try:
        runs = []
        for i in range(rounds):
            if i:
                time.sleep(pause_s)
            runs.append(bandwidth.read_bandwidth(passes=passes))
        r = max(runs, key=lambda run: run.gb_per_s)
    except NativeKernelError as e:
        return Bandwidth(float("nan"), float("nan"), 0,
                         f"no multi-threaded figure ({e}), and this one understates the peak, "
                         "so 'of roofline' may pass 100%")
    return Bandwidth(float("nan"), r.gb_per_s * 1e9, r.threads)


def measure_bandwidths(single: bool = True) -> Bandwidth:
    """Both figures: the native multi-threaded read and (if `single`) the old numpy/XLA sum."""
    bw = native_read_bandwidth()
    if single or bw.multi != bw.multi:
        bw.single = measure_single_thread_bandwidth()
    return bw


def measure_read_bandwidth() -> float:
    """Roofline read bandwidth, bytes/s: the multi-threaded native streaming read, else
    (no C++ compiler) the single-threaded numpy/XLA sum, with a note printed."""
    bw = measure_bandwidths(single=False)
    if bw.note:
        print(f"note: {bw.note}")
    return bw.roofline


def hf_generate_tps(
    model, prompts: list[list[int]], max_new_tokens: int, batch: int, reps: int = 1, lookup: int = 0
) -> float:
    """Hugging Face `generate` greedy tokens/s (median), EOS ignored; left-padded batches.
    `lookup` > 0 turns on prompt-lookup decoding with that many draft tokens."""
    return median(hf_generate_rates(model, prompts, max_new_tokens, batch, reps, lookup))


def hf_generate_rates(
    model, prompts: list[list[int]], max_new_tokens: int, batch: int, reps: int = 1, lookup: int = 0
) -> list[float]:
    """tokens/s of every batch in order (batch-major within each repetition)."""
    import torch

    model.generation_config.eos_token_id = None
    rates = []
    for _ in range(reps):
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.no_grad():
                t0 = time.perf_counter()
                model.generate(
                    ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                    do_sample=False, pad_token_id=0, eos_token_id=None,
                    **(dict(prompt_lookup_num_tokens=lookup) if lookup else {}),
                )
                dt = time.perf_counter() - t0
            rates.append(len(chunk) * max_new_tokens / dt)
    return rates


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A Markdown table, so the output pastes straight into the README."""
    fmt = lambda v: ("n/a" if v != v else f"{v:.2f}") if isinstance(v, float) else str(v)  # noqa: E731
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(fmt(v) for v in row) + " |")


# --------------------------------------------------------------------------- #
# llama.cpp peer (optional: llama-cpp-python builds llama.cpp from source)
# --------------------------------------------------------------------------- #

LLAMA_CPP_INSTALL = "pip install llama-cpp-python (it builds llama.cpp from source: ~10-20 min on 2 cores)"


def import_llama_cpp():
    """(the llama_cpp module, None) or (None, the line to print instead of the llama.cpp column)."""
    try:
        import llama_cpp
    except ImportError:
        return None, f"llama.cpp peer: skipped, the llama_cpp module is not installed; {LLAMA_CPP_INSTALL}"
    except Exception as e:  # noqa: BLE001 - a broken build raises OSError/RuntimeError while loading its library
        return None, f"llama.cpp peer: skipped, importing llama_cpp failed ({type(e).__name__}: {e}); {LLAMA_CPP_INSTALL}"
    return llama_cpp, None


def gguf_weight_bytes(path) -> int:
    """Bytes of the tensors in a GGUF (what a decode step streams), else the file size."""
    try:
        from gguf import GGUFReader

        return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    except Exception:  # noqa: BLE001 - any unreadable file: its size is the next best thing
        return os.path.getsize(path)


def gguf_file_type(path) -> str:
    """The GGUF's `general.file_type` as llama.cpp names it ("Q4_1", "ALL_F32"), else "as shipped"."""
    try:
        from gguf import GGUFReader, LlamaFileType

        field = GGUFReader(str(path)).fields["general.file_type"]
        name = LlamaFileType(int(field.parts[field.data[0]][0])).name
        return name.removeprefix("MOSTLY_")
    except Exception:  # noqa: BLE001 - unknown or missing: the label is only informative
        return "as shipped"


class _Captured:
    text = ""  # what was written, set when the block ends


@contextlib.contextmanager
def _stderr_to_file():
    """Send file descriptor 2 (C code's stderr too) to a temporary file for the block;
    the text is kept on the yielded object."""
    import sys
    import tempfile

    sys.stderr.flush()
    captured = _Captured()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        try:
            os.dup2(f.fileno(), 2)
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            captured.text = f.read().decode(errors="replace").strip()


def llama_cpp_f32_gguf(llama_cpp, src, cache_dir=None, threads: int = 0):
    """An all-F32 copy of the GGUF `src`, made once with llama.cpp's own quantizer
    (`llama_model_quantize`, ftype ALL_F32, which dequantizes every tensor) and
    cached as <jaxspec cache>/llama_cpp/<gguf key>.F32.gguf."""
    from jaxspec.models.loading import cache_root, gguf_cache_key

    src = Path(src)
    out = cache_root(cache_dir) / "llama_cpp" / f"{gguf_cache_key(src)}.F32.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")  # renamed into place: never a half-written file
    try:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True  # the input is quantized: dequantize it
        params.nthread = threads
        with _stderr_to_file() as log:  # llama.cpp logs a line per tensor on the C stderr
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0 or not tmp.is_file():
            raise RuntimeError(f"llama_model_quantize({src} -> F32) returned {rc}: {log.text[-1000:]}")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def llama_cpp_decode_rates(llama_cpp, gguf_path, prompts: list[list[int]], max_new_tokens: int, reps: int,
                           threads: int, n_ctx: int | None = None, prompt_lookup: int = 0) -> list[float]:
    """llama.cpp greedy decode tokens/s per prompt at batch 1, EOS ignored, measured like
    jaxspec's: `max_new_tokens` over the time after prefill and the first token (the
    max_new_tokens - 1 single-token forwards). The same token ids as jaxspec's prompts
    (the GGUF's vocabulary is the one jaxspec's tokenizer was converted from). One
    untimed warm-up run first; `reps` passes over the prompts. `prompt_lookup` > 0: llama-cpp-python's
    own speculative mode, prompt lookup drafting that many tokens (LlamaPromptLookupDecoding)."""
    if n_ctx is None:  # room for the longest prompt and every new token, in whole 256s (jaxspec runs 512)
        n_ctx = max(512, -(-(max(map(len, prompts)) + max_new_tokens + 1) // 256) * 256)
    draft = None
    if prompt_lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                          n_threads_batch=threads, verbose=False, draft_model=draft)
    greedy = dict(top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)

    def one(prompt: list[int]) -> float:
        llm.reset()  # prefill the whole prompt every time: no prefix reuse between runs
        gen = llm.generate(prompt, **greedy)  # yields tokens forever: stopping is ours, so EOS is ignored
        next(gen)  # prefill + first token, not timed
        t0 = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            next(gen)
        dt = time.perf_counter() - t0
        gen.close()
        return max_new_tokens / dt

    try:
        one(prompts[0])
        return [one(p) for _ in range(reps) for p in prompts]
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()


def llama_cpp_batched_rate(llama_cpp, gguf_path, prompts: list[list[int]], max_new_tokens: int,
                           threads: int) -> float:
    """llama.cpp greedy decode tokens/s over len(prompts) parallel sequences in one context (its
    `batched` example: one llama_decode per step carries a token of every sequence), EOS ignored,
    timed after the prefill and the first token, as `llama_cpp_decode_rates`."""
    n_seq = len(prompts)
    lc = llama_cpp
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf_path).encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    params = lc.llama_context_default_params()
    params.n_ctx = n_seq * (max(map(len, prompts)) + max_new_tokens + 1)
    params.n_batch = params.n_ubatch = max(sum(map(len, prompts)), n_seq)
    params.n_seq_max = n_seq
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences")
    batch = lc.llama_batch_init(params.n_batch, 0, 1)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    try:
        def decode(items):  # [(token, pos, seq, wants logits)] -> the greedy next token of each that wants them
            batch.n_tokens = len(items)
            for i, (tok, pos, seq, out) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, int(out)
                batch.seq_id[i][0] = seq
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            return [int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), (vocab,))))
                    for i, item in enumerate(items) if item[3]]

        # 1. Prefill every prompt in one batch; the logits of each prompt's last token.
        last = decode([(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)])
        pos = [len(p) for p in prompts]
        # 2. One token of every sequence per step.
        t0 = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            last = decode([(last[s], pos[s], s, True) for s in range(n_seq)])
            pos = [x + 1 for x in pos]
        return n_seq * max_new_tokens / (time.perf_counter() - t0)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def time_split(engine, reqs) -> dict | None:
    """{draft, verify, other}: fractions of one batch rerun with the phases jitted apart (the fused
    loop has no per-phase clock). Once per point: the phase functions compile on every call."""
    if engine.spec_plan is None:
        return None
    s = engine.profile_phases(reqs)["seconds"]
    total = sum(s.values())
    return {k: v / total for k, v in s.items()} if total else None
