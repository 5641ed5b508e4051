"""Generate with a Hugging Face causal LM compiled by fxopt, and print tok/s and what fxopt rewrote.

    python examples/generate.py --model llama3-8b --layers 8                   # shapes of a known model, random weights
    python examples/generate.py --model path/to/hf_checkpoint --quant rtn      # a local checkpoint, W4A16 linears
    python examples/generate.py --model path/to/hf_checkpoint --quant path/to/gptq_checkpoint
    python examples/generate.py --model qwen3-8b --backend inductor            # the same without fxopt

The decode steps run through ``generate()``'s own compile hook with a static cache
(``CompileConfig(backend=fxopt.Backend(...), options={"cudagraphs": True})``: fxopt's passes, Inductor, CUDA graphs).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import fxopt  # noqa: E402

PRESETS = {  # random-weight models of these shapes (no download)
    "llama3-8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)),
    "qwen3-8b": ("Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                     tie_word_embeddings=False)),
    "gemma3-4b": ("Gemma3TextConfig", dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                                           num_key_value_heads=4, head_dim=256, vocab_size=262144,
                                           sliding_window=1024)),
    "tiny-llama": ("LlamaConfig", dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=512)),
}


def load_model(name: str, layers: int, dtype, device):
    import transformers

    if os.path.isdir(name):
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        tok = transformers.AutoTokenizer.from_pretrained(name) if any(
            f.startswith("tokenizer") for f in os.listdir(name)) else None
        return model.to(device).eval(), tok
    cls, spec = PRESETS[name]
    cfg = getattr(transformers, cls)(num_hidden_layers=layers, max_position_embeddings=8192, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval(), None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", help=f"a local HF checkpoint directory or one of {list(PRESETS)}")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of a preset model")
    p.add_argument("--quant", default=None, help="rtn | gptq | awq | a GPTQ/AWQ checkpoint directory")
    p.add_argument("--backend", default="fxopt", choices=["fxopt", "inductor", "eager"])
    p.add_argument("--prompt", default="It is a truth universally acknowledged, that a single man in possession")
    p.add_argument("--prompt-len", type=int, default=512, help="random prompt tokens when there is no tokenizer")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    from transformers import CompileConfig

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the W4A16 kernels take 16-bit inputs
    model, tok = load_model(args.model, args.layers, dtype, device)
    if tok is not None:
        ids = tok([args.prompt] * args.batch, return_tensors="pt").input_ids.to(device)
    else:
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), device=device)

    if args.quant in ("rtn", "gptq", "awq"):
        calib = [torch.randint(0, model.config.vocab_size, (1, 512), device=device) for _ in range(4)]
        t0 = time.perf_counter()
        fxopt.quantize(model, calib, method=args.quant, group_size=128, progress=False)
        print(f"quantized ({args.quant}) in {time.perf_counter() - t0:.1f} s")
    elif args.quant:
        fxopt.load_quantized(model, args.quant)
        print(f"loaded W4A16 weights from {args.quant}")

    backend = None
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
               cache_implementation="static", pad_token_id=0)
    if args.backend == "eager":
        gen["disable_compile"] = True
    else:
        backend = fxopt.Backend(fxopt.Config(cudagraphs=True)) if args.backend == "fxopt" else "inductor"
        options = None if args.backend == "fxopt" else {"triton.cudagraphs": True}
        cc = CompileConfig(backend=backend, mode=None, options=options)
        cc._compile_all_devices = device.type != "cuda"  # the hook compiles only on accelerators otherwise
        model.generation_config.compile_config = cc

    def run(n):
        torch.cuda.synchronize() if device.type == "cuda" else None
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **dict(gen, max_new_tokens=n, min_new_tokens=n))
        torch.cuda.synchronize() if device.type == "cuda" else None
        return out, time.perf_counter() - t0

    _, first = run(args.new_tokens)  # compiles and captures
    out, t_n = run(args.new_tokens)
    _, t_1 = run(1)
    tok_s = args.batch * (args.new_tokens - 1) / (t_n - t_1)
    print(f"{args.model} backend={args.backend} quant={args.quant or 'none'} batch {args.batch}: "
          f"decode {tok_s:.1f} tok/s, first call {first:.1f} s")
    if isinstance(backend, fxopt.Backend):
        rewrites = {}
        for results in backend.results:
            for r in results:
                rewrites[r.name] = rewrites.get(r.name, 0) + r.rewrites
        print(f"fxopt rewrote ({len(backend.results)} graph(s)): "
              + ", ".join(f"{k} {v}" for k, v in rewrites.items()))
    if tok is not None:
        print(repr(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))


if __name__ == "__main__":
    main()
