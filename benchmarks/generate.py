"""End to end: Hugging Face causal LMs through the user's own path, eager / Inductor / fxopt / fxopt W4A16 / torchao.

Every row of the table is measured in the same run, on models built from configs with random weights (bf16):

* ``prefill_1x2048_ms`` / ``prefill_4x2048_ms``: ``torch.compile(model, backend=...)`` (no mode) forward,
  ``use_cache=False``; logits compared with eager's (``logits_err``: max |diff| / max |eager|).
* ``decode_b1_tok_s`` / ``decode_b8_tok_s``: ``generate()`` with ``cache_implementation="static"`` and the generation
  compile hook (``generation_config.compile_config = CompileConfig(backend=..., mode="reduce-overhead")``), prompt
  ``--prompt`` tokens; decode tok/s = batch x (N - 1) / (time(N new tokens) - time(1 new token)), so the prefill
  (which ``generate()`` runs uncompiled) is not counted. ``tokens_match``: share of greedy tokens equal to the
  reference's (eager for bf16 rows; the same quantized model run eagerly for W4A16 rows).
* ``compile_s``: the first ``generate()`` call minus a warm one of the same length (compile + CUDA-graph capture).
* ``dynamic_b1_tok_s`` / ``dynamic_compiles``: ``generate()`` with the default dynamic cache and
  ``model.forward = torch.compile(model.forward, backend=...)``: tok/s and the number of graphs compiled for the
  calls (two prompt lengths), and ``dynamic_eager_fallback`` if Dynamo gave up on a frame.
* ``graph_step_tok_s``: one decode step (batch 1, static cache) compiled without mode and captured into one
  ``torch.cuda.CUDAGraph``, replayed back to back: the ceiling of the kernels with no Python around them (as
  gpt-fast measures it).
* ``ideal_tok_s``: batch 1 decode with every weight byte and the K/V cache read once per step, at the copy bandwidth
  measured in this run.
* ``peak_gib``: peak allocated memory over the row's decode runs; ``weights_gib``: parameters + buffers.

``--profile DIR`` also writes, per row, the CUDA kernels of one compiled decode step (torch.profiler) to
``DIR/<model>_<row>_decode_kernels.txt``.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import default_out, write_results  # noqa: E402

FAMILIES = {
    # Llama-3-8B shapes
    "llama3-8b": dict(cls="LlamaConfig", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    # Qwen3-8B shapes (q/k norm, GQA 32/8, head dim 128)
    "qwen3-8b": dict(cls="Qwen3Config", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=8192,
                     tie_word_embeddings=False),
    # Gemma-3-4B text shapes (sliding window 1024 on 5 of 6 layers, head dim 256, GQA 8/4)
    "gemma3-4b": dict(cls="Gemma3TextConfig", hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, vocab_size=262144, sliding_window=1024,
                      max_position_embeddings=8192),
    # Mistral-7B-v0.3 shapes
    "mistral-7b": dict(cls="MistralConfig", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32768, sliding_window=None, max_position_embeddings=8192),
}
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
ROWS = ("eager", "inductor", "fxopt", "fxopt_w4a16_rtn", "fxopt_w4a16_rtn_head", "fxopt_w4a16_rtn_dqmm",
        "fxopt_w4a16_gptq", "torchao_int4")


def make_model(family: str, layers: int, device, tiny: bool):
    import transformers

    spec = dict(FAMILIES[family])
    cls = getattr(transformers, spec.pop("cls"))
    if tiny:
        spec.update(TINY)
        if "head_dim" in spec:
            spec["head_dim"] = 32
        if spec.get("sliding_window"):
            spec["sliding_window"] = 16
    cfg = cls(num_hidden_layers=layers, **spec)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int):
    """Median wall time (s) of ``fn()`` over ``reps`` calls after one warm call; synchronised."""
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    import triton.testing

    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median")
    del x, y
    return 2 * (1 << 30) / (ms * 1e-3)


def quantize_row(model, row: str, calib):
    import fxopt

    method = row.split("_")[2]
    t0 = time.perf_counter()
    # fxopt.quantize's default keeps the output head bf16; "_head" rows quantize it too, as torchao's quantize_ does
    fxopt.quantize(model, calib if method != "rtn" else calib[:1], method=method, group_size=128, progress=False,
                   include_head=row.endswith("_head"))
    sync()
    return time.perf_counter() - t0


def torchao_quantize(model):
    """torchao int4 weight-only (tinygemm layout); raises with the reason when torchao is missing or refuses."""
    import torchao
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    last = None
    for kw in (dict(int4_packing_format="tile_packed_to_4d"), dict(version=1), {}):
        try:
            quantize_(model, Int4WeightOnlyConfig(group_size=128, **kw))
            return f"torchao {torchao.__version__} {kw}"
        except Exception as e:  # this torchao spells the tinygemm layout differently
            last = e
    raise RuntimeError(f"torchao Int4WeightOnlyConfig failed: {last}")


def backend_for(row: str):
    if row == "eager":
        return None
    if row.startswith("fxopt"):
        return "fxopt"
    return "inductor"


def prefill(model, backend, ids, ref_logits, reps):
    import torch._dynamo

    torch._dynamo.reset()
    fwd = model if backend is None else torch.compile(model, backend=backend)
    with torch.no_grad():
        out = fwd(input_ids=ids, use_cache=False).logits
        sync()
        t = timed(lambda: fwd(input_ids=ids, use_cache=False), reps)
    err = None
    if ref_logits is not None:
        err = float((out.float() - ref_logits.float()).abs().max() / ref_logits.float().abs().max())
    return t * 1e3, err, out


def generate_tokens(model, ids, new_tokens, **kw):
    # no end-of-sequence token (make_model clears it): every call runs exactly new_tokens steps, without the
    # per-step cost of the min_new_tokens processor
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw)


def static_decode(model, backend, ids, new_tokens, reps, all_devices: bool):
    """(decode tok/s, compile s, tokens) through generate() with the static cache and the compile hook."""
    from transformers import CompileConfig

    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    kw = dict(cache_implementation="static")
    if backend is not None:
        cc = CompileConfig(backend=backend, mode="reduce-overhead")
        if all_devices:
            cc._compile_all_devices = True
        model.generation_config.compile_config = cc
    else:  # generate() compiles a static-cache decode by default: the eager row must say no
        model.generation_config.compile_config = None
        kw["disable_compile"] = True
    t0 = time.perf_counter()
    toks = generate_tokens(model, ids, new_tokens, **kw)
    sync()
    first = time.perf_counter() - t0
    t_n = timed(lambda: generate_tokens(model, ids, new_tokens, **kw), reps)
    t_1 = timed(lambda: generate_tokens(model, ids, 1, **kw), reps)
    B = ids.shape[0]
    tok_s = B * (new_tokens - 1) / max(t_n - t_1, 1e-9)
    graphs = {k: int(v) for k, v in counters["inductor"].items() if k.startswith("cudagraph")}
    graphs["graphs_compiled"] = int(counters["stats"]["unique_graphs"])
    return tok_s, max(first - t_n, 0.0), toks, graphs


def host_profile(model, ids, new_tokens, path):
    """cProfile of one warm generate() call (static cache, compile hook already compiled): where the host time of a
    token goes (transformers' loop, Dynamo's guards, the CUDA-graph tree, the compiled wrapper)."""
    import cProfile
    import io
    import pstats

    os.makedirs(os.path.dirname(path), exist_ok=True)
    prof = cProfile.Profile()
    prof.enable()
    generate_tokens(model, ids, new_tokens, cache_implementation="static")
    sync()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(35)
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(35)
    with open(path, "w") as f:
        f.write(buf.getvalue())


def dynamic_decode(model, backend, ids, new_tokens):
    """generate() with the default dynamic cache and the forward compiled: (tok/s, graphs compiled, fell back)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model.generation_config.compile_config = None
    orig = model.forward
    if backend is not None:
        model.forward = torch.compile(orig, backend=backend)
    try:
        generate_tokens(model, ids, 4)
        generate_tokens(model, ids[:, : max(ids.shape[1] // 2, 1)], 4)  # a second prompt length
        t_n = timed(lambda: generate_tokens(model, ids, new_tokens), 1)
        t_1 = timed(lambda: generate_tokens(model, ids, 1), 1)
        graphs = int(counters["stats"]["unique_graphs"])
        fallback = bool(counters["stats"].get("calls_captured", 0) == 0 and backend is not None) or bool(
            sum(v for k, v in counters["frames"].items() if "recompile_limit" in str(k)))
    finally:
        model.forward = orig
    return ids.shape[0] * (new_tokens - 1) / max(t_n - t_1, 1e-9), graphs, fallback


def graph_step(model, backend, ids, new_tokens, device, profile_path=None):
    """Decode tok/s (batch 1) of one compiled decode step replayed from one torch.cuda.CUDAGraph."""
    from transformers import StaticCache

    import torch._dynamo

    torch._dynamo.reset()
    P = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=P + new_tokens)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(P, device=device), use_cache=True)
    step_ids = ids[:, -1:].clone()
    pos = torch.tensor([P + new_tokens // 2], device=device)

    def step():
        return model(input_ids=step_ids, past_key_values=cache, cache_position=pos, position_ids=pos[None],
                     use_cache=True).logits

    fn = step if backend is None else torch.compile(step, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            fn()
        sync()
        if profile_path:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                fn()
                sync()
            with open(profile_path, "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))
        if device.type != "cuda":
            return 1.0 / timed(fn, 3)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        sync()
        import triton.testing

        ms = triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median")
    return 1e3 / ms


def ideal_tok_s(model, prompt, new_tokens, bw) -> float:
    cfg = model.config
    emb = model.get_input_embeddings().weight
    weights = model_bytes(model) - emb.numel() * emb.element_size()
    if getattr(cfg, "tie_word_embeddings", False):
        weights += emb.numel() * emb.element_size()
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * 2 * (prompt + new_tokens // 2)
    return bw / (weights + kv)


def run_row(family, row, args, device, refs, bw):
    from fxopt.kernels.w4a16 import routes

    # "_dqmm": prefill through dequantize + cuBLAS from M = 33 (fxopt.Config.kernels.w4a16_dequant_matmul "on")
    with routes(dequant_matmul="on") if row.endswith("_dqmm") else contextlib.nullcontext():
        return _run_row(family, row, args, device, refs, bw)


def _run_row(family, row, args, device, refs, bw):
    tiny = args.tiny
    res = {"model": f"{family} x{args.layers}", "row": row}
    backend = backend_for(row)
    model = make_model(family, args.layers, device, tiny)
    g = torch.Generator(device="cpu").manual_seed(1)
    vocab = model.config.vocab_size
    P, N = args.prompt, args.new_tokens
    S = 64 if tiny else 2048
    if row.startswith("fxopt_w4a16"):
        calib = [torch.randint(0, vocab, (1, min(S, 512)), generator=g).to(device) for _ in range(args.calib)]
        res["quant_s"] = quantize_row(model, row, calib)
    elif row == "torchao_int4":
        res["note"] = torchao_quantize(model)
    res["weights_gib"] = model_bytes(model) / 2**30
    quant = row.startswith("fxopt_w4a16")
    if quant or row == "torchao_int4":  # reference: the same quantized model run eagerly
        refs = dict(refs)
        for key in [k for k in refs if k[0] in ("prefill", "tokens")]:
            del refs[key]
        for b in args.prefill_batches:
            ids = torch.randint(0, vocab, (b, S), generator=torch.Generator().manual_seed(2)).to(device)
            with torch.no_grad():
                refs[("prefill", family, b, "bf16")] = model(input_ids=ids, use_cache=False).logits
        for b in args.decode_batches:
            ids = torch.randint(0, vocab, (b, P), generator=torch.Generator().manual_seed(3)).to(device)
            refs[("tokens", family, b, "bf16")] = generate_tokens(model, ids, N, cache_implementation="static",
                                                                  disable_compile=True)
    # prefill
    for b in args.prefill_batches:
        ids = torch.randint(0, vocab, (b, S), generator=torch.Generator().manual_seed(2)).to(device)
        key = ("prefill", family, b, "bf16")
        ms, err, out = prefill(model, backend, ids, refs.get(key), args.reps)
        if key not in refs:
            refs[key] = out
        res[f"prefill_{b}x{S}_ms"] = ms
        if err is not None:
            res[f"logits_err_{b}x{S}"] = err
        del out
    # decode through generate()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for b in args.decode_batches:
        ids = torch.randint(0, vocab, (b, P), generator=torch.Generator().manual_seed(3)).to(device)
        tok_s, comp, toks, graphs = static_decode(model, backend, ids, N, args.reps,
                                                  all_devices=device.type != "cuda")
        res[f"decode_b{b}_tok_s"] = tok_s
        if b == args.decode_batches[0]:
            res["decode_graphs"] = " ".join(f"{k}={v}" for k, v in sorted(graphs.items()))
        if b == args.decode_batches[0]:
            res["compile_s"] = comp
        if args.profile and b == args.decode_batches[0] and backend is not None:
            host_profile(model, ids, N, os.path.join(args.profile, f"{family}_{row}_generate_host.txt"))
        ref_key = ("tokens", family, b, "bf16")
        if ref_key in refs:
            res[f"tokens_match_b{b}"] = float((toks == refs[ref_key]).float().mean())
        else:
            refs[ref_key] = toks
    if device.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.dynamic:
        ids = torch.randint(0, vocab, (1, P), generator=torch.Generator().manual_seed(4)).to(device)
        try:
            res["dynamic_b1_tok_s"], res["dynamic_compiles"], res["dynamic_eager_fallback"] = dynamic_decode(
                model, backend, ids, N)
        except Exception as e:
            res["dynamic_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if args.graph_step:
        ids = torch.randint(0, vocab, (1, P), generator=torch.Generator().manual_seed(5)).to(device)
        prof = None
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            prof = os.path.join(args.profile, f"{family}_{row}_decode_kernels.txt")
        try:
            res["graph_step_tok_s"] = graph_step(model, backend, ids, N, device, prof)
        except Exception as e:
            res["graph_step_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    res["ideal_tok_s"] = ideal_tok_s(model, P, N, bw)
    if isinstance(res.get("graph_step_tok_s"), float) and isinstance(res.get("decode_b1_tok_s"), float):
        # what generate() adds per token around the step: its Python, Dynamo's guards, the CUDA-graph tree
        res["host_ms_per_token"] = 1e3 / res["decode_b1_tok_s"] - 1e3 / res["graph_step_tok_s"]
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def add_ratios(rows):
    base = {r["model"]: r for r in rows if r["row"] == "inductor"}
    for r in rows:
        b = base.get(r["model"])
        if b is None or r is b:
            continue
        for col in ("decode_b1_tok_s", "graph_step_tok_s"):
            if isinstance(r.get(col), float) and isinstance(b.get(col), float):
                r[col.replace("_tok_s", "_vs_inductor")] = r[col] / b[col]
        for col in [c for c in r if c.startswith("prefill_") and c.endswith("_ms")]:
            if isinstance(b.get(col), float):
                r[col.replace("_ms", "_speedup_vs_inductor")] = b[col] / r[col]


def main():
    # every row compiles from scratch: no FX-graph / AOT cache hit from an earlier row
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results; with --tiny a "
                   "temporary directory)")
    p.add_argument("--quick", action="store_true", help="llama3-8b x8 only, batch 1, fewer columns")
    p.add_argument("--models", default="llama3-8b,qwen3-8b,gemma3-4b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-batches", default="1,4")
    p.add_argument("--decode-batches", default="1,8")
    p.add_argument("--calib", type=int, default=4, help="GPTQ calibration batches of 512 tokens")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-dynamic", dest="dynamic", action="store_false")
    p.add_argument("--no-graph-step", dest="graph_step", action="store_false")
    p.add_argument("--profile", default=None, help="directory for per-row decode-step kernel tables")
    p.add_argument("--tiny", action="store_true", help="tiny configs (CPU smoke run of the script)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--append", default=None, help="a results JSON whose rows come first (one table from two runs)")
    p.add_argument("--export-w4a16-picks", default=None, metavar="PATH",
                   help="after the run, merge the W4A16 tuner's picks of this run into PATH "
                        "(fxopt/kernels/w4a16/picks_h200.json: the package's shipped table)")
    args = p.parse_args()
    args.out = args.out or default_out(args.tiny)
    import fxopt  # noqa: F401  registers backend="fxopt" when run from a checkout

    if args.quick:
        args.models = "llama3-8b"
        args.decode_batches = "1"
        args.prefill_batches = "1"
    args.prefill_batches = [int(x) for x in str(args.prefill_batches).split(",") if x]
    args.decode_batches = [int(x) for x in str(args.decode_batches).split(",") if x]
    device = torch.device(args.device)
    bw = copy_bandwidth(device)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows, refs = [], {}
    if args.append:
        import json

        with open(args.append) as f:
            earlier = json.load(f)
        rows = earlier["rows"]
        notes_extra = f" Rows before this run's came from `{earlier['command']}` ({earlier['env'].get('date', '')})."
    else:
        notes_extra = ""
    for family in args.models.split(","):
        for row in args.rows.split(","):
            print(f"== {family} x{args.layers} {row}", flush=True)
            t0 = time.perf_counter()
            try:
                r = run_row(family, row, args, device, refs, bw)
            except Exception as e:
                traceback.print_exc()
                r = {"model": f"{family} x{args.layers}", "row": row,
                     "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            r["row_s"] = time.perf_counter() - t0
            print(r, flush=True)
            rows.append(r)
            add_ratios(rows)
            write_results("generate", rows, title="End to end: Hugging Face models through generate()",
                          out_dir=args.out, echo=False,
                          notes=f"copy bandwidth {bw / 1e12:.2f} TB/s. Columns: see the docstring of "
                                "benchmarks/generate.py." + notes_extra)
    write_results("generate", rows, title="End to end: Hugging Face models through generate()", out_dir=args.out,
                  notes=f"copy bandwidth {bw / 1e12:.2f} TB/s. Columns: see the docstring of benchmarks/generate.py."
                  + notes_extra)
    if args.export_w4a16_picks:
        from fxopt.kernels import w4a16

        print(f"{w4a16.export_picks(args.export_w4a16_picks)} W4A16 picks -> {args.export_w4a16_picks}", flush=True)


if __name__ == "__main__":
    main()
