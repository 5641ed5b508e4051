"""Int4 quality of ``fxopt.quantize`` on real models (CPU): perplexity of float, RTN, and GPTQ / AWQ with their
defaults and as the papers' plain algorithms.

Models: SmolLM2-135M and Gemma-3-270M, fetched as GGUF files by ``bash /work/shared/data/get_models.sh DIR`` and
dequantized to float32 by transformers (needs ``gguf`` and ``accelerate``), each at every ``--groups`` size that
divides all its linears' in_features (a size that does not gets one row saying so). Calibration: ``--cal-samples``
windows of 512 tokens from the start of *Emma*; evaluation: ``--eval-windows`` windows of 512 tokens of *Pride and
Prejudice* (a different novel), BOS first for Gemma, perplexity over the predicted tokens. Linears are quantized
with ``pack=False`` (``nn.Linear`` holding exactly the dequantized packed weights: the same numbers as the kernels,
without the Triton interpreter on CPU); the output head stays in float (default).

Columns: ``gap_closed`` = (PPL_rtn - PPL) / (PPL_rtn - PPL_float); ``layer_err_vs_rtn`` = mean over linears of
``tr(ΔW H ΔWᵀ)`` of the method over that of RTN for the same calibration inputs (H = XᵀX over calibration tokens;
the float-target settings aim at the float model's output instead, so their value is not comparable with the plain
rows'); ``cal_s`` = wall time of ``fxopt.quantize`` (Dynamo capture included) on a shared 2-core CPU, indicative
only; ``peak_mb`` = peak resident memory during it above the float model's.

Each run overwrites ``quant_quality.md`` / ``.json`` in ``--out`` with one table. ``--merge`` instead replaces only
the (model, group) blocks this run measures in the table already there, which must come from the same calibration
and evaluation settings (its rows may be another subset of the variants); the page then lists every part's command.

Usage: ``python benchmarks/quant_quality.py [--models-dir /work/models] [--models smollm gemma] [--groups 64 128]
[--cal-samples 128] [--merge]``
"""
from __future__ import annotations

import copy
import gc
import json
import os
import shlex
import sys
import threading
import time

import torch

from common import env_info, markdown_table, parse_args

from fxopt.quant.calibrate import QuantizeReport, quantize

DATA = "/work/shared/data/austen"
NAME = "quant_quality"
TITLE = "Int4 weight quantization quality (fxopt.quantize, CPU)"
MODELS = {
    "smollm": dict(file="smollm2-135m.gguf", label="SmolLM2-135M", bos=False),
    "gemma": dict(file="gemma-3-270m.gguf", label="Gemma-3-270M", bos=True),
}
# (row name, quantize keyword arguments); the defaults come first, the plain papers' algorithms last
VARIANTS = [
    ("gptq (defaults)", dict(method="gptq")),
    ("awq (defaults)", dict(method="awq")),
    ("rtn", dict(method="rtn")),
    ("awq (nearest rounding)", dict(method="awq", awq_rounding="nearest")),
    ("gptq (plain)", dict(method="gptq", float_target=False)),
    ("awq (plain)", dict(method="awq", float_target=False, awq_rounding="nearest")),
]


class PeakRSS:
    """Peak resident set size (MiB) of this process while the context is open, sampled every 50 ms."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _rss(self) -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())


def windows(ids: list[int], n: int, length: int, bos) -> list[torch.Tensor]:
    body = length - (1 if bos is not None else 0)
    out = []
    for i in range(n):
        chunk = ids[i * body:(i + 1) * body]
        if len(chunk) < body:
            break
        out.append(torch.tensor(([bos] if bos is not None else []) + chunk)[None])
    return out


@torch.no_grad()
def perplexity(model, wins) -> tuple[float, int]:
    nll, count = 0.0, 0
    for w in wins:
        logits = model(input_ids=w, use_cache=False).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, w[0, 1:], reduction="sum"))
        count += w.shape[1] - 1
        del logits
    return float(torch.exp(torch.tensor(nll / count))), count


def load_model(key: str, models_dir: str):
    """(label, tokenizer, float32 model, BOS id or None) of one of :data:`MODELS`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = MODELS[key]
    tok = AutoTokenizer.from_pretrained(models_dir, gguf_file=spec["file"])
    model = AutoModelForCausalLM.from_pretrained(models_dir, gguf_file=spec["file"], dtype=torch.float32).eval()
    return spec["label"], tok, model, (tok.bos_token_id if spec["bos"] else None)


def text_windows(tok, book: str, n: int, bos) -> list[torch.Tensor]:
    with open(os.path.join(DATA, book), encoding="utf-8") as f:
        ids = tok(f.read(), add_special_tokens=False)["input_ids"]
    return windows(ids, n, 512, bos)


def indivisible_linears(model, group_size: int) -> list[str]:
    """Decoder linears (the head excepted) whose in_features ``group_size`` does not divide."""
    head = model.get_output_embeddings()
    return [f"{n} ({m.in_features})" for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head and m.in_features % group_size]


def release_freed_memory() -> None:
    """Return freed heap memory to the OS (glibc), so that the resident size a measurement starts from is not
    inflated by what earlier rows freed and the peak above it is comparable between rows."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may then be understated after large rows
        pass


def measure(base, cal: list, ev: list, group_size: int, kw: dict) -> dict:
    """Quantize a copy of ``base`` with ``kw`` and return its perplexity, calibration time and peak memory."""
    model = copy.deepcopy(base)
    release_freed_memory()
    rtn = kw["method"] == "rtn"
    rep = None if rtn else QuantizeReport()  # RTN with a report would run the calibration sweep for its errors
    with PeakRSS() as mem:
        t = time.perf_counter()
        quantize(model, cal, group_size=group_size, pack=False, report=rep, progress=False, **kw)
        cal_s = time.perf_counter() - t
    ppl, n_tok = perplexity(model, ev)
    ratios = [1.0] if rtn else [r["err_vs_rtn"] for r in rep.rows]
    del model
    gc.collect()
    return {"ppl": ppl, "eval_tokens": n_tok, "cal_tokens": 0 if rtn else 512 * len(cal), "cal_s": cal_s,
            "peak_mb": mem.peak - mem.base, "layer_err_vs_rtn": sum(ratios) / len(ratios)}


def run_model(key: str, args, emit) -> list[dict]:
    """Measure every selected variant of one model at every group size: its rows (``emit(rows)`` after each)."""
    t = time.perf_counter()
    label, tok, base, bos = load_model(key, args.models_dir)
    print(f"[{label}] loaded in {time.perf_counter() - t:.0f}s", flush=True)
    cal = [{"input_ids": w, "use_cache": False} for w in text_windows(tok, args.cal_text, args.cal_samples, bos)]
    ev = text_windows(tok, args.eval_text, args.eval_windows, bos)
    ppl_f, n_tok = perplexity(base, ev)
    print(f"[{label}] float PPL {ppl_f:.3f} over {n_tok} tokens", flush=True)
    rows: list[dict] = []
    for G in args.groups:
        bad = indivisible_linears(base, G)
        if bad:
            rows.append({"model": label, "group": G, "method": "(not measured)",
                         "note": f"{len(bad)} linears' in_features not divisible by {G}, e.g. {bad[0]}"})
            emit(rows)
            continue
        block = [{"model": label, "group": G, "method": "float", "ppl": ppl_f, "eval_tokens": n_tok}]
        results = {}
        # RTN first so that every other row's gap_closed is known when it is written
        for name, kw in sorted(selected(args.variants), key=lambda v: v[0] != "rtn"):
            try:
                results[name] = measure(base, cal, ev, G, kw)
            except Exception as e:  # noqa: BLE001 - record and go on with the other variants
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"[{label}] g{G} {name} failed: {e!r}", flush=True)
                continue
            r = results[name]
            ppl_rtn = results["rtn"]["ppl"]
            if name != "rtn" and ppl_rtn != ppl_f:
                r["gap_closed"] = (ppl_rtn - r["ppl"]) / (ppl_rtn - ppl_f)
            print(f"[{label}] g{G} {name}: PPL {r['ppl']:.3f} gap closed {r.get('gap_closed', float('nan')):.3f} "
                  f"cal {r['cal_s']:.0f}s peak +{r['peak_mb']:.0f} MiB", flush=True)
            emit(rows + ordered(label, G, block, results))
        rows += ordered(label, G, block, results)
    del base
    gc.collect()
    return rows


def selected(names) -> list:
    """The variants named in ``--variants`` (RTN always, since gap_closed needs it), in table order."""
    return [(n, kw) for n, kw in VARIANTS if not names or n in names or n == "rtn"]


def ordered(label, G, block, results) -> list[dict]:
    """One (model, group) block in table order: the defaults, float, RTN, then the other variants."""
    row = lambda n: {"model": label, "group": G, "method": n, **results[n]}  # noqa: E731
    defaults = [row(n) for n, _ in VARIANTS if n.endswith("(defaults)") and n in results]
    rest = [row(n) for n, _ in VARIANTS if not n.endswith("(defaults)") and n in results]
    return defaults + block + rest


def write_table(out_dir: str, parts: list[dict], settings: dict) -> None:
    """``quant_quality.md`` / ``.json``: the rows of every part (one per command), blocks in model/group order."""
    os.makedirs(out_dir, exist_ok=True)
    rank = {MODELS[k]["label"]: i for i, k in enumerate(MODELS)}
    rows = sorted((r for p in parts for r in p["rows"]), key=lambda r: (rank.get(r["model"], 99), r["group"]))
    # stable sort: the order inside a block is the one ordered() gave
    env = env_info()
    with open(os.path.join(out_dir, f"{NAME}.json"), "w") as f:
        json.dump({"title": TITLE, "env": env, "settings": settings, "parts": parts, "rows": rows}, f, indent=1)
    cmds = "\n".join(f"- `{p['command']}` ({', '.join(p['blocks'])}; {p.get('threads', 1)} CPU thread(s))"
                     for p in parts)
    digits = {"ppl": 3, "gap_closed": 3, "layer_err_vs_rtn": 3, "cal_s": 0, "peak_mb": 0}
    cols = ["model", "group", "method", "ppl", "gap_closed", "cal_s", "peak_mb", "layer_err_vs_rtn", "cal_tokens",
            "eval_tokens", "note", "error"]
    cols = [c for c in cols if any(c in r for r in rows)]
    shown = [{c: f"{r[c]:.{digits[c]}f}" if c in digits and isinstance(r.get(c), float) else r.get(c, "")
              for c in cols} for r in rows]
    variants = "\n".join(f"- {n}: `quantize(model, batches, group_size=G, "
                          + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")`"
                          for n, kw in settings["variant_kwargs"].items())
    md = (f"# {TITLE}\n\n{', '.join(f'{k} {v}' for k, v in env.items())}\n\nCommand"
          + ("" if len(parts) == 1 else "s") + f":\n\n{cmds}\n\n"
          + f"Calibration: {settings['cal_samples']} windows of {settings['cal_text']}; evaluation: "
          + f"{settings['eval_windows']} windows of {settings['eval_text']}.\n\n"
          + markdown_table(shown) + "\nRows:\n\n" + variants + "\n\n"
          + __doc__.split("\n\n", 1)[1].split("\n\nEach run")[0] + "\n")
    with open(os.path.join(out_dir, f"{NAME}.md"), "w") as f:
        f.write(md)


def main():
    def extra(p):
        p.add_argument("--models-dir", default="/work/models")
        p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
        p.add_argument("--groups", nargs="*", type=int, default=[64, 128])
        p.add_argument("--variants", nargs="*", default=None,
                       help=f"subset of the rows (RTN always runs): {', '.join(repr(n) for n, _ in VARIANTS)}")
        p.add_argument("--cal-samples", type=int, default=128)
        p.add_argument("--eval-windows", type=int, default=40)
        p.add_argument("--cal-text", default="emma.txt")
        p.add_argument("--eval-text", default="prideprejudice.txt", help="a different book than --cal-text")
        p.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads (on a CPU shared with other jobs, 1 wastes the least time spinning)")
        p.add_argument("--merge", action="store_true",
                       help="replace only this run's (model, group) blocks in the table already in --out")

    args = parse_args(__doc__.splitlines()[0], extra)
    if args.cal_text == args.eval_text:
        raise SystemExit("--eval-text must be held out from calibration (a different book than --cal-text)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    settings = {"cal_text": args.cal_text, "cal_samples": args.cal_samples, "eval_text": args.eval_text,
                "eval_windows": args.eval_windows}
    variants = dict(selected(args.variants))
    parts: list[dict] = []
    if args.merge:  # the same measurement settings; a merged block may have other rows (variants)
        with open(os.path.join(args.out, f"{NAME}.json")) as f:
            old = json.load(f)
        old_variants = old["settings"].pop("variant_kwargs", {})
        old["settings"].pop("variants", None)
        old["settings"].pop("threads", None)  # a part's own (its cal_s depends on it), shown with its command
        if old["settings"] != settings:
            raise SystemExit(f"--merge: the table in {args.out} has other settings ({old['settings']}); "
                             f"this run: {settings}")
        parts = old["parts"]
        variants = {n: kw for n, kw in VARIANTS if n in variants or n in old_variants}
    settings["variant_kwargs"] = variants
    labels = {MODELS[k]["label"] for k in args.models}
    mine = lambda r: r["model"] in labels and r["group"] in args.groups  # noqa: E731
    for p in parts:
        p["rows"] = [r for r in p["rows"] if not mine(r)]
        p["blocks"] = [b for b in p["blocks"] if not any(b == f"{m} g{g}" for m in labels for g in args.groups)]
    parts = [p for p in parts if p["rows"]]
    part = {"command": "python " + shlex.join(sys.argv), "threads": torch.get_num_threads(), "blocks": [],
            "rows": []}
    parts.append(part)
    done: list[dict] = []

    def emit(rows):
        part["rows"] = rows
        part["blocks"] = [f"{m} g{g}" for m, g in sorted({(r["model"], r["group"]) for r in rows})]
        write_table(args.out, parts, settings)

    for key in args.models:
        done += run_model(key, args, lambda rows: emit(done + rows))
        emit(done)
    print(markdown_table([r for p in parts for r in p["rows"]]))
    print(f"wrote {args.out}/{NAME}.json and .md")


if __name__ == "__main__":
    main()
